"""Route an HF decoder model (Qwen3, Qwen3-MoE, Llama) through the autograd wrappers of one kernel provider.

`apply(model, provider)` replaces module forwards in place; module names and parameters stay, so capture, the
locator and optimizers see the same model. The forward follows vLLM's decoder structure, so a provider that
runs vLLM's kernels sees the calls vLLM makes:
- the residual stream as a pair: layer i>0 starts with add+RMSNorm(previous MLP output, residual) and the
  attention output joins the residual inside the post-attention add+RMSNorm (vLLM's fused_add_rms_norm);
- q/k/v and gate/up as one GEMM each over concatenated weights when the provider fuses projections;
- neox rotary from a cos|sin table indexed by position; SiLU*mul rounded once; attention over exactly each
  sequence's keys; MoE routing top-k then the experts' outputs combined in float32 in slot order.

A decoder layer still returns hidden + residual (what HF's loop and capture hooks expect); the next layer
reads the two addends it was computed from (see ResidualStream) rather than the rounded sum.
"""

from __future__ import annotations

import contextlib
import re
import types

import torch
from torch import nn

from tic.core.errors import TicInputError
from tic.config.schema import BackwardConfig
from tic.harness.kernels import mamba_modules  # tic: Mamba-2 mixers (hybrids), issue 31
from tic.harness.kernels.autograd import Backward, Ops
from tic.harness.kernels.memo import TensorMemo
from tic.harness.kernels.stand_ins import stands_for

ATTN_NAME = "tic_rowwise"


class ResidualStream:
    """The (mlp output, residual) pair behind the tensor a decoder layer returned, for the next consumer.

    Only the exact tensor object the layer returned is matched: anything that replaces it (a hook returning a
    new tensor) makes the consumer fall back to a plain RMSNorm of what it was given."""

    def __init__(self):
        self._pending: tuple | None = None

    def put(self, out, delta, residual):
        self._pending = (out, delta, residual)

    def take(self, x):
        p, self._pending = self._pending, None
        if p is None or p[0] is not x:
            return None
        stands_for(x, p[1], p[2])  # a trail of the consumer follows x's tokens into the addends it reads instead
        return p[1], p[2]


class RopeTable:
    """cos|sin rows per position [P, rot] in the model's dtype, built by the provider (from the model's own
    rotary module, or as the provider's engine builds it), grown on demand; one table for all layers."""

    def __init__(self, rotary: nn.Module, dtype: torch.dtype, provider, config):
        self.rotary, self.dtype, self.provider, self.config, self.table = rotary, dtype, provider, config, None
        # rows a forward needs: one device read per position_ids tensor, not one per layer
        self._rows_needed = TensorMemo(lambda pos: int(pos.max()) + 1 if pos.numel() else 1)

    def for_positions(self, position_ids: torch.Tensor, device) -> torch.Tensor:
        return self.get(self._rows_needed.get(position_ids), device)

    def get(self, need: int, device) -> torch.Tensor:
        if self.table is None or self.table.shape[0] < need or self.table.device != torch.device(device):
            n = max(need, int(getattr(self.rotary, "max_seq_len_cached", 0) or 0), 1)
            # a normal tensor even when first built under inference_mode: the same model may train next (C8)
            with torch.inference_mode(False), torch.no_grad():
                self.table = self.provider.cos_sin_cache(self.rotary, self.config, n, self.dtype, device)
        return self.table


class RouteLog:
    """The top-k expert ids each wrapped MoE block of one model chooses (block name -> [ids per call]), while
    capture_routes(model) records them; None otherwise."""

    def __init__(self):
        self.calls: dict | None = None


@contextlib.contextmanager
def capture_routes(model: nn.Module):
    """Record the top-k expert ids each wrapped MoE block of `model` chooses (by block name, in call order): C7
    pins its float32 reference to the experts the path under test chose (a token near a routing tie may pick other
    experts in float32, and its gradient then goes elsewhere: not a backward fault)."""
    log: RouteLog = model._tic_routes
    prev, log.calls = log.calls, {}
    try:
        yield log.calls
    finally:
        log.calls = prev


# -- patched forwards -----------------------------------------------------------------------------------------
def _rotary_module_forward(self, x, position_ids):
    """HF's (cos, sin) looked up from the shared table: the same bits for a position whatever the batch shape
    (HF computes them per call, and CPU cos/sin vectorise by length). The wrappers read the table directly;
    this keeps what HF's own modules and capture see consistent with it."""
    need = int(position_ids.max()) + 1 if position_ids.numel() else 1
    cos, sin = self._tic_rope.get(need, x.device).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)


def _linear_forward(self, x):
    return self._tic_ops.linear(x, [self.weight], [self.bias])


def _rmsnorm_forward(self, x, residual=None):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    if residual is not None:
        return self._tic_ops.add_rms_norm(x, residual, self.weight, eps)
    return self._tic_ops.rms_norm(x, self.weight, eps)


def _final_norm_forward(self, x):
    pair = self._tic_stream.take(x)
    if pair is not None:
        return _rmsnorm_forward(self, pair[0], residual=pair[1])[0]
    return _rmsnorm_forward(self, x)


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    kwargs.pop("past_key_values", None)
    pair = self._tic_stream.take(hidden_states)
    if pair is not None:
        h, residual = self.input_layernorm(pair[0], residual=pair[1])
    else:
        residual, h = hidden_states, self.input_layernorm(hidden_states)
    h = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                       use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)[0]
    h, residual = self.post_attention_layernorm(h, residual=residual)
    delta = self.mlp(h)
    if isinstance(delta, tuple):
        delta = delta[0]
    out = residual + delta
    self._tic_stream.put(out, delta, residual)
    return out


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                       position_ids=None, **kwargs):
    ops: Ops = self._tic_ops
    B, T = hidden_states.shape[:2]
    D = self.head_dim
    projs = (self.q_proj, self.k_proj, self.v_proj)
    if ops.provider.fuse_projections:
        qkv = ops.linear(hidden_states, [p.weight for p in projs], [p.bias for p in projs])
        q, k, v = qkv.split([p.weight.shape[0] for p in projs], dim=-1)
    else:
        q, k, v = (p(hidden_states) for p in projs)
    q, k, v = q.reshape(B, T, -1, D), k.reshape(B, T, -1, D), v.reshape(B, T, -1, D)
    if getattr(self, "q_norm", None) is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    if position_ids is None:
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        position_ids = torch.arange(past, past + T, device=q.device)[None].expand(B, T)
    positions = position_ids.expand(B, T).reshape(-1)
    if self._tic_rope is not None:  # tic: attention without rotary (NemotronH), issue 31
        table = self._tic_rope.for_positions(position_ids, q.device)
        q, k = ops.rotary(q.reshape(B * T, -1, D), k.reshape(B * T, -1, D), positions, table)
    q, k, v = q.reshape(B, T, -1, D).transpose(1, 2), k.reshape(B, T, -1, D).transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    out = ops.attention(q, k, v, attention_mask, self.scaling)
    return self.o_proj(out.reshape(B, T, -1)), None


def _mlp_forward(self, x):
    ops: Ops = self._tic_ops
    if ops.provider.fuse_projections:
        gu = ops.linear(x, [self.gate_proj.weight, self.up_proj.weight],
                        [getattr(self.gate_proj, "bias", None), getattr(self.up_proj, "bias", None)])
    else:
        gu = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    return self.down_proj(ops.silu_and_mul(gu))


def _moe_forward(self, hidden_states):
    ops: Ops = self._tic_ops
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router, experts = self.gate, self.experts
    logits = ops.linear(x, [router.weight])
    weights, ids = ops.moe_route(logits, router.top_k, getattr(router, "norm_topk_prob", True))
    calls = self._tic_routes.calls
    if calls is not None:
        calls.setdefault(self._tic_name, []).append(ids.detach().to("cpu"))
    return ops.moe_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj).reshape(shape)


# -- attention mask registration (bool masks, never skipped as "causal") ---------------------------------------
def _mask_for_rowwise(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _attention_interface(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    return module._tic_ops.attention(query, key, value, attention_mask, scaling), None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention_interface)
    AttentionMaskInterface.register(ATTN_NAME, _mask_for_rowwise)


# -- recognising the modules ----------------------------------------------------------------------------------
def _is_rmsnorm(m) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight")


def _is_moe_block(m) -> bool:
    return (hasattr(m, "gate") and hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")
            and hasattr(m.gate, "weight") and hasattr(m.gate, "top_k"))


def _is_gated_mlp(m) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj"))


def _is_attention(m) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and hasattr(m, "head_dim") and hasattr(m, "layer_idx")


def _takes_rope(attention) -> bool:
    """Whether this attention applies rotary embeddings from a rotary module (NemotronH's has none)."""
    import inspect

    return "position_embeddings" in inspect.signature(type(attention).forward).parameters


def _is_decoder_layer(m) -> bool:
    return all(hasattr(m, a) for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))


def _act_name(m) -> str:
    act = getattr(m, "act_fn", None)
    return type(act).__name__ if act is not None else ""


def _norm_features(norm) -> int:
    w = getattr(norm, "weight", None)
    return int(w.shape[-1]) if w is not None and w.dim() else 0


def coverage_problems(model: nn.Module) -> list[str]:
    """What of this HF causal LM the kernel wrappers do not implement, one entry per module (name, class, what
    is missing); empty when `apply` covers every operator. Reads structure only: a model on the meta device
    will do."""
    cfg = model.config.get_text_config()
    problems = []
    layer_types = getattr(cfg, "layer_types", None) or []
    hybrid = mamba_modules.covered_layer_types(model, layer_types)  # tic: issue 31
    other = sorted({t for t in layer_types if t != "full_attention" and t not in hybrid})
    if other:
        problems.append(f"config layer_types {', '.join(other)} (the wrappers cover full attention only)")
    rotary = [n for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(rotary) > 1 or (not rotary and any(_takes_rope(m) for m in model.modules() if _is_attention(m))):
        problems.append(f"rotary embeddings: {len(rotary)} modules ({', '.join(rotary) or 'none'}), the wrappers "
                        "use one table for all layers")
    for name, m in model.named_modules():
        kind = type(m).__name__
        if mamba_modules.is_mixer(m):  # tic: issue 31
            problems += mamba_modules.mixer_problems(name, m)
        elif _is_moe_block(m):
            if any(hasattr(m, a) for a in ("shared_expert", "shared_experts")):
                problems.append(f"{name} ({kind}): shared experts")
            if "SiLU" not in _act_name(m.experts):
                problems.append(f"{name} ({kind}): activation {_act_name(m.experts) or 'unknown'}")
        elif hasattr(m, "experts") and hasattr(m, "gate"):  # e.g. NemotronH's sigmoid-routed MoE (issue 31)
            problems.append(f"{name} ({kind}): a MoE block of a layout the wrappers do not implement")
        elif _is_gated_mlp(m):
            if "SiLU" not in _act_name(m):
                problems.append(f"{name} ({kind}): activation {_act_name(m) or 'unknown'}")
        elif _is_attention(m):
            for norm_name in ("q_norm", "k_norm"):
                norm = getattr(m, norm_name, None)
                if norm is not None and _norm_features(norm) != m.head_dim:
                    problems.append(f"{name}.{norm_name} ({type(norm).__name__}): a norm over "
                                    f"{_norm_features(norm)} features (the whole projection); the wrappers "
                                    f"normalise each head of {m.head_dim}")
    final = _final_norm(model)
    if final is None or not _is_rmsnorm(final):
        problems.append("final norm (model.model.norm)")
    return _per_layer_once(problems)


def _final_norm(model: nn.Module):
    """The norm after the last layer: `norm` (decoders) or `norm_f` (Mamba-2, NemotronH) of the base model."""
    base = getattr(model, "base_model", getattr(model, "model", model))
    return getattr(base, "norm", None) or getattr(base, "norm_f", None)


def _per_layer_once(problems: list[str]) -> list[str]:
    """One entry per problem, not per layer: 'model.layers.0.x ...' and 'model.layers.3.x ...' read as
    'model.layers.{0,3}.x ...'."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        m = re.search(r"\.layers\.(\d+)\.", p)
        key = p if m is None else p[:m.start()] + ".layers.{}." + p[m.end():]
        groups.setdefault(key, []).append(m.group(1) if m else "")
    return [k if k.count("{}") == 0 else k.replace("{}", "{" + ",".join(v) + "}" if len(v) > 1 else v[0], 1)
            for k, v in groups.items()]


def apply(model: nn.Module, provider, backward: BackwardConfig | None = None) -> nn.Module:
    """Patch an HF causal LM in place so every operator runs through `provider` with a surrogate backward (run as
    `backward` says: tic.yaml train.backward). Idempotent for one provider; raises TicInputError for what the
    wrappers do not cover."""
    done = getattr(model, "_tic_provider", None)
    if done is not None:
        if done is not provider:
            raise TicInputError(f"model already runs {done.name} kernels")
        return model
    problems = coverage_problems(model)
    if problems:
        raise TicInputError(f"{provider.name} kernel wrappers do not cover: " + "; ".join(problems))
    layout = mamba_modules.install(model, provider)  # tic: issue 31
    register_attention()
    ops = Ops(provider, Backward(backward))
    cfg = model.config.get_text_config()
    stream, routes = ResidualStream(), RouteLog()
    dtype = next(model.parameters()).dtype
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    rope = RopeTable(rotary[0], dtype, provider, cfg) if rotary else None
    if rotary:
        rotary[0]._tic_orig_forward, rotary[0]._tic_rope = rotary[0].forward, rope
        rotary[0].forward = types.MethodType(_rotary_module_forward, rotary[0])
    for name, m in list(model.named_modules()):
        m._tic_ops = ops
        if mamba_modules.is_mixer(m):  # tic: issue 31
            mamba_modules.wrap_mixer(m, layout)
        elif _is_moe_block(m):
            m._tic_name, m._tic_routes = name, routes
            m.forward = types.MethodType(_moe_forward, m)
        elif _is_gated_mlp(m):
            m.forward = types.MethodType(_mlp_forward, m)
        elif _is_attention(m):
            m._tic_rope = rope
            m.forward = types.MethodType(_attention_forward, m)
        elif _is_decoder_layer(m):
            m._tic_stream = stream
            m.forward = types.MethodType(_decoder_layer_forward, m)
        elif isinstance(m, nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
        elif _is_rmsnorm(m):
            m.forward = types.MethodType(_rmsnorm_forward, m)
    final = _final_norm(model)
    final._tic_stream = stream
    final.forward = types.MethodType(_final_norm_forward, final)
    for sub in model.modules():
        c = getattr(sub, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            c._attn_implementation = ATTN_NAME
    model._tic_provider = provider
    model._tic_ops, model._tic_routes = ops, routes
    return model
