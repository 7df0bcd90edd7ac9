"""Route an HF decoder model through the autograd wrappers of one kernel provider.

What the wrappers cover is data (coverage.py: the operator classes, which kernels implement each, and the
reader that finds them in a model); `apply` refuses a model that uses anything else and patches each module by
the class the reader found: two-norm (Llama, Qwen, Mistral), four-norm (Gemma-2/3) and post-norm (OLMo-2)
decoder layers, `w` and `(1 + w)` RMSNorms, SiLU and GELU-tanh gated MLPs, top-k MoE, full, sliding-window and
softcapped attention, q/k norms per head or over the whole projection, one rotary table or one per layer type,
final logit softcapping.

`apply(model, provider)` replaces module forwards in place; module names and parameters stay, so capture, the
locator and optimizers see the same model. The forward follows vLLM's decoder structure, so a provider that
runs vLLM's kernels sees the calls vLLM makes:
- the residual stream as a pair: layer i>0 starts with add+RMSNorm(previous MLP output, residual) and the
  attention output joins the residual inside the post-attention add+RMSNorm (vLLM's fused_add_rms_norm);
- q/k/v and gate/up as one GEMM each over concatenated weights when the provider fuses projections;
- neox or interleaved rotary from a cos|sin table indexed by position; SiLU*mul (GELU-tanh*mul) rounded once;
  attention over exactly each sequence's keys (the window's, on a sliding layer); MoE routing top-k then the
  experts' outputs combined in float32 in slot order;
- a four-norm layer as vLLM's Gemma layers: post-attention norm alone, then add+norm (pre-feedforward) of the
  residual, MLP, post-feedforward norm; the next layer's input add+norm takes that output and the residual;
- a post-norm layer as vLLM's Olmo3 layer: each sublayer's output normed alone, then a plain residual add;
- whole-projection q/k norms (OLMoE) on the [tokens, heads * head_dim] views of the fused qkv output, before
  the heads split, as vLLM's OlmoeAttention passes them.

A decoder layer still returns hidden + residual (what HF's loop and capture hooks expect); the next layer
reads the two addends it was computed from (see ResidualStream) rather than the rounded sum.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import types

import torch
from torch import nn

from tic.core.errors import TicInputError
from tic.config.schema import BackwardConfig
from tic.harness.kernels import mamba_modules  # tic: Mamba-2 mixers (hybrids), issue 31
from tic.harness.kernels import mla
from tic.harness.kernels.autograd import OPS, Backward, Ops
from tic.harness.kernels.coverage import (attention_clip, attention_layer_type, attention_name, attention_sinks,
                                          attention_softcap, attention_window, expert_weights, final_norm,
                                          handed_bias, head_dim_of, is_attention, is_decoder_layer, is_gated_mlp,
                                          is_hybrid_block, is_moe_block, logits_scaling_settable, mlp_name,
                                          moe_router, output_projection_name, problem_lines, read_coverage,
                                          residual_scale_name, rotary_modules, rotary_per_layer_type, router_routing,
                                          router_weight, routing_bias_name)
from tic.harness.kernels.fp8 import FP8_OPS
from tic.harness.kernels.memo import TensorMemo
from tic.harness.kernels.norms import is_layernorm, is_rmsnorm, norm_eps
from tic.harness.kernels.rope import rotary_output_layout, sin_negated, spread_angles
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

    def pending(self, x):
        """The (delta, residual) pair x was summed from, if x is the tensor now pending; the pair stays pending."""
        p = self._pending
        return None if p is None or p[0] is not x else (p[1], p[2])

    def take(self, x):
        p, self._pending = self._pending, None
        if p is None or p[0] is not x:
            return None
        stands_for(x, p[1], p[2])  # a trail of the consumer follows x's tokens into the addends it reads instead
        return p[1], p[2]


class RopeTable:
    """cos|sin rows per position [P, rot] in the model's dtype, built by the provider (from the model's own
    rotary module, or as the provider's engine builds it), grown on demand; one table for all layers, or one per
    layer type (`layer_type`: the key a per-layer-type rotary module takes)."""

    def __init__(self, rotary: nn.Module, dtype: torch.dtype, provider, config, layer_type: str | None = None,
                 interleaved: bool = False, reversed_: bool = False):
        self.rotary, self.dtype, self.provider, self.config, self.table = rotary, dtype, provider, config, None
        self.layer_type = layer_type
        self.reversed = reversed_  # coverage's rope:reversed: the table holds -sin, the wrappers turn the other way
        self.op = "rotary_interleaved" if interleaved else "rotary"  # the rotation its attention runs with it
        # rows a forward needs: one device read per position_ids tensor, not one per layer
        self._rows_needed = TensorMemo(lambda pos: int(pos.max()) + 1 if pos.numel() else 1)

    def for_positions(self, position_ids: torch.Tensor, device) -> torch.Tensor:
        return self.get(self._rows_needed.get(position_ids), device)

    def get(self, need: int, device) -> torch.Tensor:
        if self.table is None or self.table.shape[0] < need or self.table.device != torch.device(device):
            n = max(need, int(getattr(self.rotary, "max_seq_len_cached", 0) or 0), 1)
            # a normal tensor even when first built under inference_mode: the same model may train next (C8)
            extra = (self.layer_type,) if self.layer_type is not None else ()
            with torch.inference_mode(False), torch.no_grad():
                table = self.provider.cos_sin_cache(self.rotary, self.config, n, self.dtype, device, *extra)
                self.table = sin_negated(table) if self.reversed else table
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
def _rotary_module_forward(self, x, position_ids, layer_type=None):
    """HF's (cos, sin) looked up from the shared table (the layer type's, for a module holding one per type):
    the same bits for a position whatever the batch shape (HF computes them per call, and CPU cos/sin vectorise
    by length). The wrappers read the table directly; this keeps what HF's own modules and capture see
    consistent with it."""
    need = int(position_ids.max()) + 1 if position_ids.numel() else 1
    rope = self._tic_ropes[layer_type]
    cos, sin = rope.get(need, x.device).chunk(2, dim=-1)
    sin = -sin if rope.reversed else sin  # the module's own angles: its attention turns them the other way
    cos, sin = (spread_angles(t, self._tic_layout) for t in (cos, sin))  # in the module's own layout
    return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)


def _linear_forward(self, x):
    return self._tic_ops.linear(x, [self.weight], [self.bias])


def _rms_weight(self, x):
    """The RMSNorm's weight, or for a norm without one (nanochat's) a unit weight as wide as x in x's dtype: the
    wrappers' RMSNorm rounds x_hat to the dtype before the weight, so a product by 1 keeps its bits."""
    w = getattr(self, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    unit = self.__dict__.get("_tic_unit_weight")
    if unit is None or unit.shape[-1] != x.shape[-1] or unit.dtype != x.dtype or unit.device != x.device:
        unit = self.__dict__["_tic_unit_weight"] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return unit


def _rmsnorm_forward(self, x, residual=None):
    eps, offset, w = norm_eps(self), getattr(self, "_tic_norm_offset", 0.0), _rms_weight(self, x)
    if residual is not None:
        return self._tic_ops.add_rms_norm(x, residual, w, eps, offset)
    return self._tic_ops.rms_norm(x, w, eps, offset)


def _layernorm_forward(self, x, residual=None):
    """A LayerNorm as vLLM's models run it: torch's nn.LayerNorm (op layer_norm) or one written out in float32
    (Cohere; op layer_norm_float32), `_tic_layer_norm_op`; with weight + 1 in the weight's dtype for Nemotron's
    LayerNorm1P (`_tic_weight_plus_one`, as HF and vLLM add it); where the layer joins the residual, a plain add
    (residual + x) and the norm of the sum, no fused add+norm."""
    norm = getattr(self._tic_ops, self._tic_layer_norm_op)
    w, b, eps = getattr(self, "weight", None), getattr(self, "bias", None), norm_eps(self)
    if getattr(self, "_tic_weight_plus_one", False):
        w = w + 1
    if residual is not None:
        total = residual + x
        return norm(total, w, b, eps), total
    return norm(x, w, b, eps)


def _each_head_norm_forward(self, x):
    """A norm of its own for each head (coverage.each_head_norms), on the wrappers' [..., heads, head size] rows:
    head h through the module's h-th norm (itself wrapped)."""
    norms = next(iter(self.children()))
    return torch.stack([norm(x[..., h, :].contiguous()) for h, norm in enumerate(norms)], dim=-2)


def _lm_head_softcap_forward(self, x):
    """lm_head then the final logit softcap (the model's own forward no longer applies it: apply moved it
    here), as vLLM's logits processor runs it on the model-dtype logits."""
    return self._tic_ops.softcap(_linear_forward(self, x), self._tic_softcap)


def _stream_norm_forward(self, x):
    """A norm handed a layer's returned sum (the final norm; a hybrid block's norm): the add+norm of the pair behind
    it, as vLLM joins the residual inside the next norm, else a plain norm."""
    norm = _layernorm_forward if hasattr(self, "_tic_layer_norm_op") else _rmsnorm_forward
    pair = self._tic_stream.take(x)
    if pair is not None:
        return norm(self, pair[0], residual=pair[1])[0]
    return norm(self, x)


def _hybrid_block_forward(self, hidden_states, *args, **kwargs):
    """A one-norm block around one mixer (NemotronH, Mamba-2) as transformers runs it (norm, mixer, residual add),
    its output registered with the pair it was summed from (the mixer's output, the block's input): the next
    block's norm and the final norm read that pair, as vLLM's hybrid layers pass (mixer output, residual) on and
    join them in their next fused add+norm."""
    out = self._tic_block_forward(hidden_states, *args, **kwargs)
    delta, self._tic_mixer_out = self._tic_mixer_out, None
    if isinstance(out, torch.Tensor) and isinstance(delta, torch.Tensor) and delta.shape == out.shape \
            and delta.dtype == out.dtype == hidden_states.dtype:
        self._tic_stream.put(out, delta, hidden_states)
    return out


def _keep_mixer_output(block):
    def hook(module, args, out):
        block._tic_mixer_out = out[0] if isinstance(out, tuple) else out
    return hook


def _wrap_hybrid_blocks(model: nn.Module, stream: ResidualStream) -> None:
    """Hybrid blocks whose residual stays in the model dtype join the residual stream (_hybrid_block_forward)."""
    for m in model.modules():
        if not is_hybrid_block(m) or not is_rmsnorm(m.norm) or getattr(m, "residual_in_fp32", False):
            continue
        m._tic_stream, m._tic_mixer_out, m._tic_block_forward = stream, None, m.forward
        m.mixer.register_forward_hook(_keep_mixer_output(m))
        m.forward = types.MethodType(_hybrid_block_forward, m)
        m.norm._tic_stream = stream
        m.norm.forward = types.MethodType(_stream_norm_forward, m.norm)


def _attend(layer, h, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs):
    """The layer's attention (self_attn, or GPT-NeoX's attention) on h: its output, the weights dropped; the cache
    as the layer was handed it."""
    cache = _layer_cache(cache, kwargs)  # before kwargs are passed on: it takes the cache's other names out
    if getattr(layer, "_tic_mixes_by_scan", False):  # a Mamba mixer in the attention's place: its output alone
        return getattr(layer, layer._tic_attn_name)(h, cache=cache, attention_mask=attention_mask)
    return getattr(layer, layer._tic_attn_name)(hidden_states=h, attention_mask=attention_mask,
                                                position_ids=position_ids, cache=cache, use_cache=use_cache,
                                                position_embeddings=position_embeddings, **kwargs)[0]


def _layer_cache(cache, kwargs: dict):
    """The KV cache a layer was handed: as `cache` (transformers 5.2x), `past_key_values`, or `layer_past`
    (GPT-NeoX); the other names are taken out of kwargs so the attention call does not get them twice."""
    for name in ("past_key_values", "layer_past"):
        other = kwargs.pop(name, None)
        cache = cache if cache is not None else other
    return cache


def _layer_attention(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings,
                     kwargs):
    """(attention output, residual): the input add+norm (or plain norm for the first layer) and attention."""
    pair, norm = self._tic_stream.take(hidden_states), _norm(self, "input_layernorm")
    if pair is not None:
        h, residual = norm(pair[0], residual=pair[1])
    else:
        residual, h = hidden_states, norm(hidden_states)
    h = _attend(self, h, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs)
    return h, residual


def _mlp(self) -> nn.Module:
    """The layer's MLP (or MoE) child: mlp, or feed_forward (Jamba)."""
    return getattr(self, getattr(self, "_tic_mlp_name", None) or "mlp")


def _norm(self, role: str) -> nn.Module:
    """The layer's norm playing `role` (coverage.NORM_DATAFLOW's names): the child of that name, or the one the
    dataflow probe found in that place (coverage.norm_roles, for norms named otherwise: the coverage reading)."""
    return getattr(self, getattr(self, "_tic_norm_roles", {}).get(role, role))


def _layer_out(self, delta, residual):
    if isinstance(delta, tuple):
        delta = delta[0]
    out = residual + delta
    self._tic_stream.put(out, delta, residual)
    return out


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """A two-norm layer (Llama, Qwen): the attention output joins the residual in the post-attention add+norm."""
    h, residual = _layer_attention(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                                   position_embeddings, kwargs)
    h, residual = _norm(self, "post_attention_layernorm")(h, residual=residual)
    return _layer_out(self, _mlp(self)(h), residual)


def _four_norm_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                             use_cache=False, position_embeddings=None, **kwargs):
    """A four-norm layer (Gemma-2/3), in vLLM's order: the attention output normed alone, then joined to the
    residual by the pre-feedforward add+norm; the MLP output normed (post-feedforward) before the residual add."""
    h, residual = _layer_attention(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                                   position_embeddings, kwargs)
    h = _norm(self, "post_attention_layernorm")(h)
    h, residual = _norm(self, "pre_feedforward_layernorm")(h, residual=residual)
    delta = _mlp(self)(h)
    return _layer_out(self, _norm(self, "post_feedforward_layernorm")(delta[0] if isinstance(delta, tuple)
                                                                      else delta), residual)


def _post_norm_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                             use_cache=False, position_embeddings=None, **kwargs):
    """A post-norm layer (OLMo-2), as vLLM's Olmo3DecoderLayer runs it: no input norm; each sublayer's output
    normed alone, then a plain add to the residual (no fused add+norm: the next layer and the final norm read
    the sum)."""
    h = _attend(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs)
    h = hidden_states + _norm(self, "post_attention_layernorm")(h)
    delta = _mlp(self)(h)
    return h + _norm(self, "post_feedforward_layernorm")(delta[0] if isinstance(delta, tuple) else delta)


def _scaled_residual_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                                   use_cache=False, position_embeddings=None, **kwargs):
    """A two-norm layer whose sublayer outputs are scaled before the residual add (Granite's residual_multiplier,
    MiniCPM3's residual_scale), as vLLM's GraniteDecoderLayer runs it: plain norms, output * scale, then a plain
    add (no fused add+norm: the next layer and the final norm read the sum)."""
    scale = getattr(self, self._tic_residual_scale)
    h = _attend(self, self.input_layernorm(hidden_states), attention_mask, position_ids, cache, use_cache,
                position_embeddings, kwargs)
    h = hidden_states + h * scale
    delta = _mlp(self)(self.post_attention_layernorm(h))
    return h + (delta[0] if isinstance(delta, tuple) else delta) * scale


def _side_by_side(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs):
    """(attention, MLP) outputs of a one-norm parallel layer: both on input_layernorm(x)."""
    h = self.input_layernorm(hidden_states)
    attn = _attend(self, h, attention_mask, position_ids, cache, use_cache, position_embeddings, kwargs)
    delta = _mlp(self)(h)
    return attn, delta[0] if isinstance(delta, tuple) else delta


def _parallel_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                            use_cache=False, position_embeddings=None, **kwargs):
    """One norm feeding attention and the MLP side by side (Phi), summed as vLLM's PhiLayer sums them:
    (attention + MLP) + residual, plain adds."""
    attn, mlp = _side_by_side(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                              position_embeddings, kwargs)
    return attn + mlp + hidden_states


def _parallel_residual_first_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                                           use_cache=False, position_embeddings=None, **kwargs):
    """One norm feeding attention and the MLP side by side, summed residual + attention + MLP in that order, as
    transformers' and vLLM's Cohere layers sum them."""
    attn, mlp = _side_by_side(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                              position_embeddings, kwargs)
    return hidden_states + attn + mlp


def _parallel_two_norm_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                                     use_cache=False, position_embeddings=None, **kwargs):
    """Attention on input_layernorm(x) and the MLP on post_attention_layernorm(x) side by side (GPT-NeoX
    use_parallel_residual), summed as vLLM's GPTNeoXLayer and transformers sum them: MLP + attention + residual."""
    attn = _attend(self, _norm(self, "input_layernorm")(hidden_states), attention_mask, position_ids, cache,
                   use_cache, position_embeddings, kwargs)
    delta = _mlp(self)(_norm(self, "post_attention_layernorm")(hidden_states))
    return (delta[0] if isinstance(delta, tuple) else delta) + attn + hidden_states


def _returning(forward, count: int):
    """A layer forward that returns its output as the first of `count` values (the rest None), as the model's
    own layer did (coverage.layer_output_count)."""
    def returning(self, *args, **kwargs):
        return (forward(self, *args, **kwargs),) + (None,) * (count - 1)
    return returning


LAYER_FORWARDS = {"decoder:two_norm": _decoder_layer_forward, "decoder:four_norm": _four_norm_layer_forward,
                  "decoder:parallel": _parallel_layer_forward,
                  "decoder:parallel_residual_first": _parallel_residual_first_layer_forward,
                  "decoder:parallel_two_norm": _parallel_two_norm_layer_forward,
                  "decoder:scaled_residual": _scaled_residual_layer_forward,
                  "decoder:post_norm": _post_norm_layer_forward}


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                       position_ids=None, **kwargs):
    ops: Ops = self._tic_ops
    B, T = hidden_states.shape[:2]
    D = self._tic_head_dim
    if hasattr(self, "query_key_value"):  # one fused linear, split where the model's forward takes q, k, v
        fused = self.query_key_value(hidden_states)
        q, k, v = (fused.index_select(-1, i.to(fused.device)) for i in self._tic_qkv_index)
    elif hasattr(self, "qkv_proj"):  # one fused [q | k | v] linear (Phi-3), split as the model splits it
        cfg = self.config
        q_width, kv_width = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        q, k, v = self.qkv_proj(hidden_states).split([q_width, kv_width, kv_width], dim=-1)
    elif ops.provider.fuse_projections:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qkv = ops.linear(hidden_states, [p.weight for p in projs], [p.bias for p in projs])
        q, k, v = qkv.split([p.weight.shape[0] for p in projs], dim=-1)
    else:
        q, k, v = (p(hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
    qk_norms = self._tic_qk_norms  # names (q, k) or None; after the rotary where the forward puts them there
    if self._tic_norm_projection:  # OLMoE, OLMo-2: [B, T, heads * D] views of the fused output, as vLLM's passes
        q, k = getattr(self, qk_norms[0])(q), getattr(self, qk_norms[1])(k)
    dv, scale = self._tic_value or (D, 1.0)  # values of their own head size and scale (coverage.value_reading)
    q, k, v = q.reshape(B, T, -1, D), k.reshape(B, T, -1, D), v.reshape(B, T, -1, dv)
    if scale != 1.0:
        v = v * scale  # in the model's dtype, as the model's forward scales them
    if qk_norms is not None and not self._tic_norm_projection and not self._tic_qk_after_rope:
        q, k = getattr(self, qk_norms[0])(q), getattr(self, qk_norms[1])(k)
    if self._tic_clip is not None:  # elementwise, after the norms (transformers' OLMoE order)
        q, k, v = (t.clamp(-self._tic_clip, self._tic_clip) for t in (q, k, v))
    position_ids, positions = _positions(self, position_ids, cache, B, T, q.device)
    if self._tic_rope is not None:  # tic: attention without rotary (NemotronH), issue 31
        table = self._tic_rope.for_positions(position_ids, q.device)
        q, k = getattr(ops, self._tic_rope.op)(q.reshape(B * T, -1, D), k.reshape(B * T, -1, D), positions, table)
    if qk_norms is not None and self._tic_qk_after_rope:  # HunYuan: contiguous [tokens, heads, D], as vLLM's passes
        q, k = (getattr(self, n)(t.reshape(B * T, -1, D).contiguous()) for n, t in zip(qk_norms, (q, k)))
    q, k, v = q.reshape(B, T, -1, D).transpose(1, 2), k.reshape(B, T, -1, D).transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    out = ops.attention(q, k, v, _bool_mask(attention_mask), self.scaling, softcap=self._tic_softcap,
                        window=self._tic_window, sinks=self.sinks if self._tic_sinks else None).reshape(B, T, -1)
    if self._tic_output_gate is not None:  # coverage.output_gate_reading: (gate linear, function, per head)
        name, function, per_head = self._tic_output_gate
        out = ops.output_gate(getattr(self, name)(hidden_states), out, function, per_head)
    return getattr(self, self._tic_out_proj)(out), None


def _mla_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                           position_ids=None, **kwargs):
    """A latent attention (tic.harness.kernels.mla): every projection and norm through the module's own (wrapped)
    children, the rotary (in the layout coverage read) and the attention through the provider's operators; the
    cache holds each head's full key and value."""
    ops: Ops = self._tic_ops
    B, T = hidden_states.shape[:2]
    q = mla.query(self, hidden_states)
    q_nope, q_rot, k_nope, k_rot, v = mla.split_heads(self, q, self.kv_a_proj_with_mqa(hidden_states),
                                                      self.kv_a_layernorm, self.kv_b_proj)
    position_ids, positions = _positions(self, position_ids, cache, B, T, q.device)
    table = self._tic_rope.for_positions(position_ids, q.device)
    rot, heads = int(self.qk_rope_head_dim), q_nope.shape[-2]
    turn = ops.rotary_interleaved if self._tic_mla_layout == "pairs" else ops.rotary
    q_rot, k_rot = turn(q_rot.reshape(B * T, -1, rot).contiguous(), k_rot.reshape(B * T, -1, rot).contiguous(),
                        positions, table)
    q = torch.cat([q_nope, q_rot.reshape(B, T, heads, rot)], -1).transpose(1, 2)
    k = torch.cat([k_nope, k_rot.reshape(B, T, 1, rot).expand(B, T, heads, rot)], -1).transpose(1, 2)
    v = v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    out = ops.attention(q, k, v, _bool_mask(attention_mask), self.scaling)
    return self.o_proj(out.reshape(B, T, -1)), None


def _positions(attn, position_ids, cache, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [B, T], their flat rows): the ones given, else the next T after what the cache holds."""
    if position_ids is None:
        past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
        position_ids = torch.arange(past, past + T, device=device)[None].expand(B, T)
    return position_ids, position_ids.expand(B, T).reshape(-1)


def _bool_mask(mask):
    """HF's additive float mask (0 = attend) as the bool mask the provider's attention takes (True = attend)."""
    return mask == 0 if mask is not None and mask.dtype != torch.bool else mask


def _plain_mlp_forward(self, x):
    """An ungated MLP (StarCoder2's c_fc / act / c_proj): up projection, the activation, down projection. An
    activation module of the model's own (kind "own": Apertus' xIELU) runs as it is, one row at a time."""
    up, down, kind = self._tic_plain
    if kind == "own":
        return down(self._tic_ops.provider.per_row(getattr(self, self._tic_plain_act), up(x)))
    return down(self._tic_ops.activation(up(x), kind))


def _mlp_forward(self, x):
    ops: Ops = self._tic_ops
    if hasattr(self, "gate_up_proj"):  # one fused [gate | up] linear (Phi-3, GLM)
        gu = self.gate_up_proj(x)
    elif ops.provider.fuse_projections:
        gu = ops.linear(x, [self.gate_proj.weight, self.up_proj.weight],
                        [getattr(self.gate_proj, "bias", None), getattr(self.up_proj, "bias", None)])
    else:
        gu = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    act = ops.gelu_tanh_and_mul if self._tic_act == "mlp:gelu_tanh_and_mul" else ops.silu_and_mul
    return self.down_proj(act(gu))


def _moe_forward(self, hidden_states):
    ops: Ops = self._tic_ops
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router, experts, routing = moe_router(self), self.experts, self._tic_routing
    w = router_weight(router)
    b = getattr(router, self._tic_logit_bias) if self._tic_logit_bias else None  # GPT-OSS's router linear bias
    # a router kept in float32 in a bf16 model (GLM-4.5's) takes its rows in float32, as HF's and vLLM's do
    logits = ops.linear(x if x.dtype == w.dtype else x.to(w.dtype), [w], [b])
    bias = operator.attrgetter(self._tic_bias)(self).reshape(-1) if self._tic_bias else None
    weights, ids = ops.moe_route(logits, router.top_k, routing, bias)
    calls = self._tic_routes.calls
    if calls is not None:
        calls.setdefault(self._tic_name, []).append(ids.detach().to("cpu"))
    if self._tic_own_experts:  # experts of the model's own that act on each token alone (coverage)
        out = ops.provider.per_token_experts(experts, x, weights, ids)
    else:
        out = ops.moe_experts(x, weights, ids, *expert_weights(experts))
    shared = getattr(self, self._tic_shared, None) if self._tic_shared else None  # a gated MLP on every token
    if shared is not None:  # sigmoid-gated where the block has the gate (Qwen2-MoE)
        y = shared(x)
        gate = getattr(self, "shared_expert_gate", None)
        # vLLM: shared_output + fused_output. One add of two model-dtype tensors is computed in float32 and
        # rounded once, so a block that sums them in float32 (HunYuan-V3's fp32 combine) gives the same bits
        out = (ops.sigmoid_gate(gate(x), y) if gate is not None else y) + out
    return out.reshape(shape)


# -- attention mask registration (bool masks, never skipped as "causal") ---------------------------------------
# the position ids of the wrapped model's forward now running, for its mask functions (_record_positions)
_MODEL_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("tic_model_positions", default=None)


def _mask_for_rowwise(*args, **kwargs):
    """transformers' sdpa mask, never skipped as "causal", and confined to each sequence of a packed row (position
    ids that do not step by one, no padding mask, no cache) as transformers confines it where a model hands its
    position ids to its mask functions. Some models do not (GPT-OSS), and their packed rows would attend across
    sequences; the ids come from the model's own forward (_record_positions). Built once per forward, outside
    every layer, so a layer's operators are the same in every layout."""
    from transformers.masking_utils import and_masks, find_packed_sequence_indices, packed_sequence_mask_function
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    positions, q, kv = _MODEL_POSITIONS.get(), kwargs.get("q_length"), kwargs.get("kv_length")
    if positions is not None and kwargs.get("attention_mask") is None and positions.shape[-1] == q == kv \
            and not kwargs.get("q_offset") and not kwargs.get("kv_offset"):
        packed = find_packed_sequence_indices(positions.expand(kwargs["batch_size"], -1))
        if packed is not None:
            kwargs["mask_function"] = and_masks(kwargs["mask_function"], packed_sequence_mask_function(packed))
    return sdpa_mask(*args, **kwargs)


def _record_positions(module, args, kwargs):
    """Forward pre-hook of the wrapped model: its call's position ids, for _mask_for_rowwise (a call with a cache
    passes none: its rows are one sequence each)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    module._tic_positions_token = _MODEL_POSITIONS.set(kwargs.get("position_ids") if cache is None else None)


def _forget_positions(module, args, kwargs, output):
    token = module.__dict__.pop("_tic_positions_token", None)  # not kept: a copy of the model cannot copy a token
    if token is not None:
        _MODEL_POSITIONS.reset(token)


def _attention_interface(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None,
                         sliding_window=None, **kwargs):
    return module._tic_ops.attention(query, key, value, attention_mask, scaling, softcap=softcap,
                                     window=sliding_window), None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention_interface)
    AttentionMaskInterface.register(ATTN_NAME, _mask_for_rowwise)


def _wrap_rotary(model: nn.Module, provider, dtype, cfg, interleaved: bool = False, reversed_: bool = False) -> dict:
    """The rotary table(s), by layer type (None: the one table of all layers), and the rotary module patched to
    read them; interleaved: the attention turns pairs 2i, 2i+1 with them (coverage's rope:interleaved); reversed_:
    by minus each angle (rope:reversed)."""
    if not rotary_modules(model):  # tic: a model without rotary (Mamba-2, NemotronH), issue 31
        return {}
    rotary = rotary_modules(model)[0][1]
    types_ = sorted(set(getattr(cfg, "layer_types", None) or [])) if rotary_per_layer_type(rotary) else [None]
    ropes = {t: RopeTable(rotary, dtype, provider, cfg, t, interleaved, reversed_) for t in types_}
    rotary._tic_orig_forward, rotary._tic_ropes = rotary.forward, ropes
    rotary._tic_layout = rotary_output_layout(rotary)
    rotary.forward = types.MethodType(_rotary_module_forward, rotary)
    return ropes


def _rope_of(m: nn.Module, ropes: dict, cfg):
    """The rotary table this attention reads: its layer type's, or the one table; None only for a model without
    rotary. A per-type table that cannot be matched is an error, never an attention left without rotary."""
    if not ropes:
        return None
    if None in ropes:
        return ropes[None]
    kind = attention_layer_type(m, cfg)
    if kind not in ropes:
        raise RuntimeError(f"attention {type(m).__name__} (layer {getattr(m, 'layer_idx', '?')}): layer type "
                           f"{kind!r} has no rotary table (tables: {', '.join(sorted(ropes))})")
    return ropes[kind]


def _lm_head_scaled_forward(self, x):
    """lm_head then the logits times 1 / logits_scaling, as vLLM's logits processor scales the model-dtype logits
    (a product by the reciprocal, not transformers' division; one rounding per element either way)."""
    return _linear_forward(self, x) * self._tic_logit_scale


def _wrap_logits(model: nn.Module, cfg) -> None:
    """Final logit softcapping (or Granite's logits_scaling) moved from the model's forward into lm_head's,
    through the wrappers' softcap (on CPU one row at a time) or vLLM's scaling rule. The wrapped model's config
    then reads None (scaling: 1.0) there: the value lives in lm_head, and a wrapped model is never saved."""
    cap = getattr(cfg, "final_logit_softcapping", None)
    head = model.get_output_embeddings()
    scaling = getattr(cfg, "logits_scaling", None)
    if head is not None and scaling is not None and float(scaling) != 1.0 and logits_scaling_settable(cfg):
        head._tic_logit_scale = 1.0 / float(scaling)
        head.forward = types.MethodType(_lm_head_scaled_forward, head)
        for c in {id(model.config): model.config, id(cfg): cfg}.values():
            c.logits_scaling = 1.0  # now applied once, in lm_head
        return
    if cap is None or head is None:
        return
    head._tic_softcap = float(cap)
    head.forward = types.MethodType(_lm_head_softcap_forward, head)
    for c in {id(model.config): model.config, id(cfg): cfg}.values():
        if getattr(c, "final_logit_softcapping", None) is not None:
            c.final_logit_softcapping = None  # now applied once, in lm_head


def _wrap_module(name: str, m: nn.Module, variant, ropes: dict, stream, routes, cfg, layout=None,
                 reading: dict | None = None) -> None:
    """reading: what coverage's probes read of this module (norm roles, a fused qkv's layout, no rotary)."""
    reading = reading or {}
    if mamba_modules.is_scan_mixer(m):  # tic: issue 31
        mamba_modules.wrap_mixer(m, layout)
    elif is_moe_block(m):
        m._tic_name, m._tic_routes = name, routes
        m._tic_routing = reading.get("routing") or router_routing(moe_router(m), cfg, handed_bias(m))
        # where the bias lives, by name: the forward reads the tensor the block holds then (a weight sync may swap it)
        m._tic_bias = routing_bias_name(m) if m._tic_routing is not None and m._tic_routing.biased else None
        m._tic_shared = reading.get("shared_expert")  # a name: a module attribute would register it twice
        m._tic_logit_bias = reading.get("logit_bias")
        m._tic_own_experts = bool(reading.get("own_experts"))
        m.forward = types.MethodType(_moe_forward, m)
    elif is_gated_mlp(m):
        m._tic_act = variant
        m.forward = types.MethodType(_mlp_forward, m)
    elif variant is not None and variant.startswith("mlp:plain:"):  # coverage: mlp:plain:<up>:<down>:<act>:<kind>
        up, down, act, kind = variant.split(":")[2:]
        m._tic_plain, m._tic_plain_act = (getattr(m, up), getattr(m, down), kind), act
        m.forward = types.MethodType(_plain_mlp_forward, m)
    elif mla.is_mla_attention(m):
        m._tic_rope, m._tic_mla_layout = _rope_of(m, ropes, cfg), reading["mla_rope"]
        m.forward = types.MethodType(_mla_attention_forward, m)
    elif is_attention(m):
        m._tic_out_proj = output_projection_name(m)
        m._tic_head_dim = head_dim_of(m)
        m._tic_rope = None if reading.get("no_rope") else _rope_of(m, ropes, cfg)
        m._tic_qkv_index = reading.get("qkv_index")  # coverage refuses a fused qkv whose layout it cannot read
        m._tic_window, m._tic_softcap = attention_window(m, cfg), attention_softcap(m, cfg)
        m._tic_norm_projection, m._tic_clip = variant == "attention:qk_norm_projection", attention_clip(m, cfg)
        m._tic_qk_norms = reading.get("qk_norms")
        m._tic_qk_after_rope = bool(reading.get("qk_norm_after_rotary"))
        m._tic_sinks = attention_sinks(m, cfg) is not None  # a flag: the forward reads the parameter it holds then
        m._tic_value = reading.get("value")
        m._tic_output_gate = reading.get("output_gate")
        m.forward = types.MethodType(_attention_forward, m)
    elif is_decoder_layer(m):
        m._tic_stream = stream
        m._tic_attn_name = attention_name(m)  # a name: a module attribute would register the attention twice
        m._tic_mlp_name = mlp_name(m)
        m._tic_mixes_by_scan = mamba_modules.is_scan_mixer(getattr(m, m._tic_attn_name))  # Jamba's, Bamba's
        m._tic_norm_roles = reading.get("norm_roles", {})  # names, for the same reason
        m._tic_residual_scale = residual_scale_name(m)  # Granite's residual_multiplier, MiniCPM3's residual_scale
        count = reading.get("output_count", 0)
        m.forward = types.MethodType(_returning(LAYER_FORWARDS[variant], count) if count else LAYER_FORWARDS[variant],
                                     m)
    elif isinstance(m, nn.Linear):
        m.forward = types.MethodType(_linear_forward, m)
    elif variant == "norm:each_head":  # StableLM: the attention hands it [.., heads, head size] rows
        m.forward = types.MethodType(_each_head_norm_forward, m)
    elif is_layernorm(m) or variant in ("norm:layer", "norm:layer_float32", "norm:layer_1p"):
        m._tic_eps = reading.get("eps")
        m._tic_layer_norm_op = "layer_norm_float32" if variant == "norm:layer_float32" else "layer_norm"
        m._tic_weight_plus_one = variant == "norm:layer_1p"
        m.forward = types.MethodType(_layernorm_forward, m)
    elif is_rmsnorm(m) or variant in ("norm:rms", "norm:rms_1p"):
        m._tic_eps = reading.get("eps")
        m._tic_norm_offset = 1.0 if variant == "norm:rms_1p" else 0.0
        m.forward = types.MethodType(_rmsnorm_forward, m)


def apply(model: nn.Module, provider, backward: BackwardConfig | None = None, quant=None) -> nn.Module:
    """Patch an HF causal LM in place so every operator runs through `provider` with a surrogate backward (run as
    `backward` says: tic.yaml train.backward). Idempotent for one provider; raises TicInputError for what the
    provider does not cover (coverage.py), one line per module. quant: the block-FP8 copies of a quantized
    model's weights (tic.harness.kernels.fp8), whose linears and experts then run the provider's FP8 kernels."""
    done = getattr(model, "_tic_provider", None)
    if done is not None:
        if done is not provider:
            raise TicInputError(f"model already runs {done.name} kernels")
        return model
    coverage = read_coverage(model)
    problems = problem_lines(coverage, provider.kernels)
    if str(getattr(provider, "kv_cache_dtype", "auto")).startswith("fp8") and \
            any("attention:sinks" in cov.classes for cov in coverage):
        problems.append("attention sinks with an FP8 KV cache (its attention rule has no sinks)")
    if problems:
        raise TicInputError(f"kernels: {provider.kernels} does not cover: " + "; ".join(problems))
    variants = {name: v for cov in coverage for name, v in cov.variants.items()}
    readings = {name: r for cov in coverage for name, r in cov.readings.items()}
    register_attention()
    ops = Ops(provider, Backward(backward), {**OPS, **FP8_OPS} if quant is not None else None, quant)  # fp8
    cfg = model.config.get_text_config()
    stream, routes = ResidualStream(), RouteLog()
    interleaved = any("rope:interleaved" in cov.classes for cov in coverage)
    reversed_ = any("rope:reversed" in cov.classes for cov in coverage)
    ropes = _wrap_rotary(model, provider, next(model.parameters()).dtype, cfg, interleaved, reversed_)
    layout = mamba_modules.install(model)  # tic: the sequences Mamba-2 mixers read, issue 31
    for name, m in list(model.named_modules()):
        m._tic_ops = ops
        _wrap_module(name, m, variants.get(name), ropes, stream, routes, cfg, layout, readings.get(name))
    _wrap_hybrid_blocks(model, stream)
    _wrap_logits(model, cfg)
    final = final_norm(model)
    final._tic_stream = stream
    final.forward = types.MethodType(_stream_norm_forward, final)
    for sub in model.modules():
        c = getattr(sub, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            c._attn_implementation = ATTN_NAME
    model.register_forward_pre_hook(_record_positions, with_kwargs=True)
    model.register_forward_hook(_forget_positions, with_kwargs=True, always_call=True)
    model._tic_provider = provider
    model._tic_ops, model._tic_routes = ops, routes
    return model
