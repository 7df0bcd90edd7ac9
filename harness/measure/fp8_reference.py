"""C7's reference for a block-FP8 model: plain transformers in float32 whose quantized linears and experts give
the FP8 forward's values with the unquantized graph's gradient (visible + (graph - graph.detach()), method 3.1).

The path under test runs the inference kernels forward and differentiates each operator against the master
weights, quantization treated as identity. Compared with the plain model, its gradients then differ by the FP8
forward itself (activations a few percent apart), which no backward fault causes. So the reference follows the
same trajectory: each quantized module's output is, in value, the fake-quantized computation (activations
quantized per token group by the deployment format, weights the checkpoint's codes times scales, float32
arithmetic), and, for autograd, the module's own float32 graph. Where the deployment rounds its scales to powers
of two (vLLM's DeepGEMM path with UE8M0 scales), the training side's operators show it (fp8_rule) and the
reference rounds alike. Its backward is transformers' autograd through
that graph: nothing of tic's kernel wrappers or written-out backwards is on its path.

With an FP8 KV cache (method 4.2) both engines' attention is FlashAttention's FP8 forward: q, k and v rounded to
e4m3 (scale 1: vLLM's uncalibrated scales), and the probabilities P = exp(s - max), scaled by 2**8 to use e4m3's
range, rounded to e4m3 as well before the P @ V product (the row sum stays float32). `use_fp8_kv_cache` gives a
transformers model that attention in value, and for autograd the model's own eager attention on the unrounded
q, k, v (straight through, as the training side's attention backward): C7's reference and C2's stock model then
compute the model the two sides run. Their rounding takes the path under test's q, k, v where recorded, as their
quantizers take its activations (QuantizerInputs).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from tic.harness.kernels import fp8_rule
from tic.harness.kernels.autograd import ATTENTION_INPUTS
from tic.harness.kernels.fp8 import QuantizedCopies, attach_checkpoint
from tic.harness.kernels.fp8_cpu import e4m3_round
from tic.harness.kernels.fp8_rule import Fp8Rule, KvRule
from tic.harness.model.quantize import dequantize_weight_blocks


def _straight_through(visible: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
    return visible.detach().to(graph.dtype) + (graph - graph.detach())


class _RuleWeights:
    """A quantized weight's float32 values under a scale rule (Fp8Rule.tiles), its requantized tiles kept while
    its copy is unchanged: requantizing every weight per forward would cost more than the reference's arithmetic."""

    def __init__(self, quant: QuantizedCopies, rule: Fp8Rule):
        self.quant, self.rule = quant, rule
        self._held: dict[int, tuple] = {}

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        codes, scales = self.quant.get(w)
        if self.rule.weights_ue8m0:
            state = (codes.data_ptr(), codes._version, scales._version)
            held = self._held.get(id(w))
            if held is None or held[0] != state:
                held = self._held[id(w)] = (state, self.rule.tiles(codes, scales, self.quant.block))
            codes, scales = held[1]
        return dequantize_weight_blocks(codes, scales, self.quant.block, torch.float32)


class QuantizerInputs:
    """What the path under test's FP8 steps rounded for the sequence the reference runs now (`current`, as
    Ops.capture_inputs records it): by quantized parameter name the activations its block-FP8 operators quantized,
    under ATTENTION_INPUTS the (q, k, v) of each attention over an FP8 KV cache, in call order. Rounding to e4m3 is a
    step function: float32 and bf16 values a rounding apart fall on different codes in a few percent of elements,
    and the two forwards then drift apart by the format's step, which no backward fault causes. Where given, the
    reference's rounding steps take these inputs, as its routers take the path under test's experts; its own graph
    still carries the gradient. Counts, per kind, the calls that took them and those that ran on their own."""

    def __init__(self):
        self.current: dict[str, list] | None = None
        self.taken = 0
        self.own = 0
        self.attention_taken = 0
        self.attention_own = 0

    def take(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        got = self.take_shaped(name, tuple(x.shape), x.device)
        return x if got is None else got

    def take_shaped(self, name: str | None, shape: tuple, device) -> torch.Tensor | None:
        """The next recorded input of `name` if it has this shape (counted as taken), else None (counted as own)."""
        calls = (self.current or {}).get(name)
        if calls and tuple(calls[0].shape) == tuple(shape):
            self.taken += 1
            return calls.pop(0).to(device=device)
        self.own += 1
        return None

    def take_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """The next recorded attention's (q, k, v) where their shapes are these, else these."""
        calls = (self.current or {}).get(ATTENTION_INPUTS)
        if calls and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(calls[0], (q, k, v))):
            self.attention_taken += 1
            return tuple(t.to(device=q.device) for t in calls.pop(0))
        self.attention_own += 1
        return q, k, v

    def counts(self, whose: str) -> dict[str, int]:
        """The record's figures: FP8 quantizer and FP8-cache attention calls on `whose` inputs and on their own."""
        out = {}
        if self.taken or self.own:
            out.update({f"fp8_quantizer_calls_on_the_{whose}_inputs": self.taken,
                        "fp8_quantizer_calls_on_their_own_inputs": self.own})
        if self.attention_taken or self.attention_own:
            out.update({f"fp8_kv_attention_calls_on_the_{whose}_inputs": self.attention_taken,
                        "fp8_kv_attention_calls_on_their_own_inputs": self.attention_own})
        return out


def _linear_hook(quant: QuantizedCopies, inputs: QuantizerInputs | None, rule: Fp8Rule):
    weights = _RuleWeights(quant, rule)

    def hook(m, args, out):
        x = args[0] if inputs is None else inputs.take(quant.name_of(m.weight), args[0])
        vis = F.linear(rule.activations(x.float(), quant.block[1]), weights(m.weight),
                       None if m.bias is None else m.bias.detach().float())
        return _straight_through(vis, out)
    return hook


def _experts_hook(quant: QuantizedCopies, inputs: QuantizerInputs | None, rule: Fp8Rule):
    weights = _RuleWeights(quant, rule)

    def hook(m, args, kwargs, out):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        x, ids, w = (*args, *(kwargs[n] for n in names[len(args):]))
        gu, down = weights(m.gate_up_proj), weights(m.down_proj)
        between = None  # the down projection's inputs, one row per (token, top-k slot)
        if inputs is not None:
            x = inputs.take(quant.name_of(m.gate_up_proj), x)
            between = inputs.take_shaped(quant.name_of(m.down_proj), (ids.numel(), gu.shape[1] // 2), x.device)
        g = quant.block[1]
        vis = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            if not 0 <= e < gu.shape[0]:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if between is None:
                gate, up = F.linear(rule.activations(x[tok].float(), g), gu[e]).chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = between[tok * ids.shape[1] + slot].float()
            y = F.linear(rule.activations(h, g), down[e])
            vis.index_add_(0, tok, y * w[tok, slot, None].detach().float())
        return _straight_through(vis, out)
    return hook


def describe_rules(rules: dict) -> dict[str, str]:
    """A record's view of the rules the reference rounded by (a rule not identified: the default)."""
    default = {"kv_attention": fp8_rule.DEFAULT_KV}
    return {k: r.describe() if r is not None else
            f"not identified; rounded as {default.get(k, fp8_rule.DEFAULT).describe()}" for k, r in rules.items()}


def install(model: nn.Module, model_dir, inputs: QuantizerInputs | None = None,
            rules: dict[str, Fp8Rule | None] | None = None) -> list | None:
    """For a block-FP8 checkpoint: load its master weights and codes into `model` (built without quantization)
    and hook every quantized linear and expert block as above; the hook handles. None for any other checkpoint.
    inputs: where the quantizers take the path under test's activations (C7); rules: the scale rule of the
    deployment's linears and experts (fp8_rule.detect_*; missing or None: the checkpoint's scales, amax / 448)."""
    quant = attach_checkpoint(model, model_dir)
    if quant is None:
        return None
    rule = {k: (rules or {}).get(k) or fp8_rule.DEFAULT for k in ("linear", "experts")}
    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and quant.covers([m.weight]):
            handles.append(m.register_forward_hook(_linear_hook(quant, inputs, rule["linear"])))
        elif hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and quant.covers([m.gate_up_proj, m.down_proj]):
            handles.append(m.register_forward_hook(_experts_hook(quant, inputs, rule["experts"]), with_kwargs=True))
    return handles


# -- the FP8 KV cache ---------------------------------------------------------------------------------------------
FP8_KV_ATTENTION = "tic_fp8_kv_eager"  # the name it is registered under in transformers' attention interface


def fp8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """t rounded to e4m3 and back, saturating at its largest finite value as vLLM's FP8 cache and query quantizers
    do; the gradient passes straight through."""
    return t + (e4m3_round(t.detach()) - t).detach()


def fp8_attention(query, key, value, attention_mask, scaling: float, groups: int, softcap: float | None = None,
                  rule: KvRule = fp8_rule.DEFAULT_KV):
    """Attention over an FP8 KV cache in value, by the deployment's rule (fp8_rule.KvRule; by default
    FlashAttention's FP8 forward: q, k, v rounded to e4m3, P = exp(s - row max) * 2**8 rounded to e4m3 for P @ V,
    divided by the float32 row sum of the unrounded P). [B, H, Q, D] / [B, Hk, K, D] inputs, an additive mask or
    None; returns [B, Q, H, Dv] in query's dtype."""
    return rule.attention(query, key, value, attention_mask, scaling, groups, softcap)


def _fp8_kv_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if own is None:
        raise RuntimeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward to run the "
                           "FP8 KV cache's reference attention with")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError(f"{type(module).__name__}: attention sinks have no FP8 KV cache reference")
    graph, weights = own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    inputs, rule = getattr(module, KV_STATE_ATTR, (None, None))
    q, k, v = (query, key, value) if inputs is None else inputs.take_attention(query, key, value)
    visible = fp8_attention(q, k, v, attention_mask, scaling, q.shape[1] // k.shape[1], kwargs.get("softcap"),
                            rule or fp8_rule.DEFAULT_KV)
    return _straight_through(visible, graph), weights


KV_STATE_ATTR = "_tic_fp8_kv"  # where use_fp8_kv_cache leaves a model's (QuantizerInputs, KvRule) for its attention


def use_fp8_kv_cache(model: nn.Module, inputs: QuantizerInputs | None = None, rule: KvRule | None = None) -> None:
    """Run `model`'s attention over an FP8 KV cache in value (fp8_attention by `rule`, by default FlashAttention's
    FP8 forward), its own eager attention on the unrounded q, k, v for autograd; inputs: where its rounding takes
    the path under test's q, k, v."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(FP8_KV_ATTENTION, _fp8_kv_eager)
    # the masks eager attention takes: a name without a mask function of its own gets none (no causal mask)
    AttentionMaskInterface.register(FP8_KV_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(FP8_KV_ATTENTION)
    for m in model.modules():  # the attention interface is global; the inputs and rule belong to this model
        setattr(m, KV_STATE_ATTR, (inputs, rule))


def follow_deployment(model: nn.Module, model_dir, kv_cache_dtype: str, inputs: QuantizerInputs | None = None,
                      rules: dict[str, Fp8Rule | None] | None = None) -> None:
    """Make a transformers model compute, in value, the model the deployed sides run: for a block-FP8 checkpoint
    its FP8 forward (install), with an FP8 KV cache FlashAttention's FP8 attention (use_fp8_kv_cache); a plain
    checkpoint with a model-dtype cache stays as it is. C2's stock model and C7's reference both are this model
    (C7's quantizers take the path under test's inputs: QuantizerInputs)."""
    install(model, model_dir, inputs, rules)
    if str(kv_cache_dtype).startswith("fp8"):
        use_fp8_kv_cache(model, inputs, (rules or {}).get("kv_attention"))
