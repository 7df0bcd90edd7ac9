"""Declared coverage: the operator classes and layer kinds the kernel wrappers implement, and which kernels do.

`REGISTRY` is the data: one `OperatorClass` per thing the wrappers compute (a norm variant, an attention kind,
an activation, a decoder-layer structure, ...), with the `kernels:` values (tic.yaml) whose provider implements
it. `read_coverage(model)` reads an HF causal LM's structure (a model on the meta device will do) into one
`LayerCoverage` per decoder layer plus one for the model's own modules (embedding, rotary, final norm, logits):
the classes each uses and what it uses that no registry entry covers (a `Refusal`, naming the module, its class,
the missing operator and the config field and value that made it so).

Norms and activations are recognised by what they compute, not by their class name: the module's own forward
runs on a small CPU probe and its output is compared with each registered variant (norms.py for norms, their
epsilon included; SiLU, GELU-tanh). A norm or activation that matches none is refused, never guessed: a wrong guess
would make both sides agree bitwise on another model, which only C7 would notice.

Adding an operator or layer kind: guides/extend.md.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import re
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tic.harness.kernels import mamba_modules  # tic: Mamba-2 hybrids, issue 31
from tic.harness.kernels import mla
from tic.harness.kernels.autograd import OUTPUT_GATES, PLAIN_ACTS, gate_output_ref, moe_experts_ref
from tic.harness.kernels.norms import is_norm, is_weightless_norm, norm_eps, norm_reading, probe_input
from tic.harness.kernels.rope import (rotary_output_layout, rotate_interleaved, rotate_neox, sin_negated,
                                     spread_angles)
from tic.harness.kernels.routing import SCORES, Routing, choice, select
from tic.harness.kernels.routing import scores as routing_scores, weights as routing_weights
from tic.harness.model.inventory import LAYER_LISTS

KERNELS = ("consistent", "vllm")  # tic.yaml train.kernels values that run through the wrappers
_BOTH = frozenset(KERNELS)


@dataclass(frozen=True)
class OperatorClass:
    name: str
    what: str
    kernels: frozenset = _BOTH  # the kernels whose provider implements it


REGISTRY: dict[str, OperatorClass] = {c.name: c for c in [
    OperatorClass("decoder:two_norm", "input norm, attention, post-attention norm, MLP (Llama, Qwen, Mistral)"),
    OperatorClass("decoder:four_norm", "input norm, attention, post-attention norm, residual add, "
                                       "pre-feedforward norm, MLP, post-feedforward norm (Gemma-2/3)"),
    OperatorClass("decoder:post_norm", "no input norm; attention, its output normed then added to the residual; "
                                       "MLP, likewise (OLMo-2); plain adds, no fused add+norm",
                  frozenset({"consistent"})),  # vLLM 0.26 runs OLMo-2 through its Transformers backend (HF rotary)
    OperatorClass("decoder:parallel_two_norm", "attention on input_layernorm(x) and the MLP on "
                                               "post_attention_layernorm(x) side by side, MLP + attention + residual "
                                               "(GPT-NeoX use_parallel_residual)"),
    OperatorClass("attention:qkv_fused", "one fused query_key_value linear, split into q, k and v where the "
                                        "model's own forward takes them (per head: GPT-NeoX; grouped or q-then-k-v: "
                                        "Falcon), the layout read by computation"),
    OperatorClass("decoder:scaled_residual", "input norm, attention, post-attention norm, MLP, each sublayer output "
                                             "times residual_multiplier before a plain residual add (Granite)"),
    OperatorClass("decoder:parallel_residual_first", "one input norm feeding attention and MLP side by side, "
                                                     "summed residual + attention + MLP in that order (Cohere), "
                                                     "read by computation"),
    OperatorClass("decoder:parallel", "one input norm feeding attention and MLP side by side, attention + MLP + "
                                      "residual (Phi, vLLM's order)"),
    OperatorClass("norm:rms", "RMSNorm w * x_hat, x_hat rounded to the model dtype first (Llama, Qwen)"),
    OperatorClass("norm:rms_1p", "RMSNorm (1 + w) * x_hat in float32, rounded once (Gemma)"),
    OperatorClass("norm:layer_float32", "a LayerNorm written out in float32 and rounded once: (x - mean) * "
                                        "rsqrt(var + eps) * w (+ b) (Cohere's CohereLayerNorm, vLLM's "
                                        "layer_norm_func), read by computation"),
    OperatorClass("norm:layer", "torch's LayerNorm (w * (x - mean) / std + b); where it joins the residual, a plain "
                                "add then the norm of the sum, as vLLM's models run nn.LayerNorm (StableLM)"),
    OperatorClass("norm:layer_1p", "torch's LayerNorm with weight w + 1 (added in the weight's dtype): Nemotron's "
                                   "LayerNorm1P, as HF and vLLM compute it, read by computation"),
    OperatorClass("attention:full", "causal attention over each sequence's keys"),
    OperatorClass("attention:sliding", "causal attention over the last `sliding_window` keys (Gemma, Mistral)"),
    OperatorClass("attention:softcap", "attention scores cap * tanh(s / cap) (Gemma-2 attn_logit_softcapping)"),
    OperatorClass("attention:qk_norm", "RMSNorm of each q and k head (Qwen3, Gemma-3)"),
    OperatorClass("attention:qk_norm_after_rotary", "the per-head q/k RMSNorms applied to the rotated heads "
                                                   "(HunYuan), read from the attention's forward"),
    OperatorClass("attention:qk_norm_each_head", "a norm of its own for each q and each k head (StableLM's "
                                                 "qk_layernorm: a LayerNorm per head), read from its forward",
                  frozenset({"consistent"})),
    OperatorClass("attention:qk_norm_projection", "RMSNorm of the whole q and k projections before the heads "
                                                  "split (OLMoE, OLMo-2)"),
    OperatorClass("attention:clip_qkv", "q, k and v clamped to +-clip_qkv after the q/k norms (OLMoE clip_qkv; "
                                        "vLLM 0.26's OLMoE does not clamp)", frozenset({"consistent"})),
    OperatorClass("linear", "GEMM, with or without bias"),
    OperatorClass("mlp:silu_and_mul", "gated MLP, silu(gate) * up rounded once"),
    OperatorClass("mlp:gelu_tanh_and_mul", "gated MLP, gelu_tanh(gate) * up rounded once (Gemma)"),
    OperatorClass("mlp:plain", "an ungated MLP: up projection, one elementwise activation (GELU, GELU-tanh, ReLU "
                               "or SiLU, torch's, or ReLU squared), down projection (StarCoder2, GPT-2-style, "
                               "Arcee)"),
    OperatorClass("mlp:own_activation", "an ungated MLP whose activation is a module of the model's own that acts "
                                        "on each token's row alone (Apertus' xIELU, with learned parameters): its "
                                        "forward one row at a time in float32, rounded once, trained through its "
                                        "own autograd", frozenset({"consistent"})),
    OperatorClass("mlp:plain_vllm_kernel", "an ungated MLP whose activation name (gelu_new, gelu_fast, ...) vLLM "
                                           "runs through a kernel of its own, not torch's function",
                  frozenset({"consistent"})),
    OperatorClass("moe:topk_silu", "softmax top-k router, SiLU experts combined in float32 in slot order"),
    OperatorClass("moe:own_experts", "routed experts of the model's own whose forward on (rows, top-k ids, "
                                     "top-k weights) acts on each token alone, checked on a CPU probe (GPT-OSS's "
                                     "clamped SwiGLU on interleaved gate/up columns with biases): run as the model "
                                     "defines them, one token at a time, trained through their own autograd",
                  frozenset({"consistent"})),
    OperatorClass("moe:score_router", "a router in the DeepSeek-V3 way: sigmoid (or softmax) scores, a selection "
                                      "bias that only chooses, grouped top-k, weights renormalised or not and "
                                      "times routed_scaling_factor (GLM-4.5, MiniMax-M2); vLLM's side not yet "
                                      "measured", frozenset({"consistent"})),
    OperatorClass("moe:shared_expert", "a gated MLP on every token, times sigmoid of a one-feature linear where "
                                       "the block has one (Qwen2-MoE) or as it is (HunYuan's shared_mlp), added "
                                       "to the routed experts' output"),
    OperatorClass("attention:sinks", "a learned logit per head beside every row's keys, in the softmax and "
                                     "dropped from it (GPT-OSS's attention sinks, a trained parameter); vLLM's side "
                                     "(FA3's s_aux) not yet measured", frozenset({"consistent"})),
    OperatorClass("attention:value_head", "values of another head size than queries and keys, scaled by a constant "
                                          "where the forward scales them (MiMo-V2-Flash's v_head_dim and "
                                          "attention_value_scale), both read from the attention's own forward",
                  frozenset({"consistent"})),
    OperatorClass("attention:mla", "multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value "
                                   "projections with their norms, per-head keys and values from one latent, rotary "
                                   "features shared by every head; vLLM's MLA kernels not yet wrapped",
                  frozenset({"consistent"})),
    OperatorClass("rope:one_table", "neox rotary, one cos|sin table for all layers"),
    OperatorClass("attention:no_rope", "attention on a layer that applies no position embeddings though the model "
                                       "has a rotary table (NoPE: SmolLM3's no_rope_layers, EXAONE-4's full layers)"),
    OperatorClass("rope:per_layer_type", "neox rotary, one table per layer type (Gemma-3 local/global bases)"),
    OperatorClass("rope:interleaved", "interleaved rotary: features 2i and 2i+1 turned together (GLM; vLLM's "
                                      "is_neox_style=False), on the table's first features"),
    OperatorClass("attention:output_gate", "the attention output times function(gate linear(x)) before the output "
                                           "projection, per element or per head (sigmoid: AFMoE, LFM3; softplus: "
                                           "Laguna), read by computation"),
    OperatorClass("rope:reversed", "the rotary turned the other way (nanochat's rotate_half with the signs "
                                   "flipped): the wrappers' rotation with the table's sin negated, read by "
                                   "computation"),
    OperatorClass("embedding", "token embedding"),
    OperatorClass("embedding:scaled", "token embedding times a constant in the model dtype (Gemma sqrt(hidden))"),
    OperatorClass("embedding:tied", "lm_head shares the embedding's weight"),
    OperatorClass("logits:softcap", "final logits cap * tanh(z / cap) (Gemma-2 final_logit_softcapping)"),
    OperatorClass("logits:hidden_scaled_by_model", "the last hidden states divided by logits_scaling before lm_head, "
                                                   "by the model's own forward (MiniCPM3): elementwise, the same on "
                                                   "every side; vLLM's side not yet wrapped",
                  frozenset({"consistent"})),
    OperatorClass("logits:scaled", "final logits times 1 / logits_scaling in the model dtype, as vLLM's logits "
                                   "processor scales them (Granite)"),
    # tic: Mamba-2 hybrids (issue 31); tic.harness.kernels.mamba holds the kernels, mamba_modules the wrapper
    OperatorClass("decoder:hybrid_block", "norm, one mixer (Mamba-2, attention or MLP), residual add (Mamba-2, "
                                          "NemotronH)"),
    OperatorClass("mixer:mamba2", "Mamba-2 mixer: causal conv, chunked scan whose decode replays prefill's "
                                  "chunks, gated grouped RMSNorm"),
    OperatorClass("mixer:mamba1", "Mamba-1 mixer: causal conv, selective scan token by token (decode continues "
                                  "prefill's recurrence), gated by silu(z)"),
    # relu2 runs as HF's relu then square: the float product of two model-dtype values is exact, rounded once,
    # as vLLM's _C.relu_squared rounds it
    OperatorClass("mlp:relu2", "up, relu(x)^2, down (NemotronH)"),
]}

DECODER_NORMS = {("input_layernorm", "post_attention_layernorm"): "decoder:two_norm",
                 ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"): "decoder:four_norm",
                 ("post_attention_layernorm", "post_feedforward_layernorm"): "decoder:post_norm",
                 ("input_layernorm",): "decoder:parallel"}


@dataclass(frozen=True)
class Refusal:
    module: str
    module_class: str
    missing: str
    field: str | None = None
    value: object = None

    def line(self) -> str:
        why = f" (config {self.field}={self.value!r})" if self.field is not None else ""
        return f"{self.module} ({self.module_class}): {self.missing}{why}"


@dataclass
class LayerCoverage:
    layer: str  # "model.layers.3", or "model" for the modules outside the decoder layers
    module_class: str
    classes: dict = field(default_factory=dict)  # operator class -> (config field, value) that selected it
    refusals: list = field(default_factory=list)
    variants: dict = field(default_factory=dict)  # module name -> the operator class it computes (apply reads it)
    readings: dict = field(default_factory=dict)  # module name -> {what a probe read of it} (apply reads it too)

    def covered_by(self) -> list[str]:
        """The kernels whose provider implements every operator class of this layer (none if anything is
        refused)."""
        if self.refusals:
            return []
        return [k for k in KERNELS if all(k in REGISTRY[c].kernels for c in self.classes)]

    def problems(self, kernels: str) -> list[str]:
        """One line per thing `kernels` does not implement here."""
        out = [r.line() for r in self.refusals]
        for c, (fld, val) in self.classes.items():
            if kernels not in REGISTRY[c].kernels:
                out.append(Refusal(self.layer, self.module_class, f"{c} is not implemented by kernels: {kernels}",
                                   fld, val).line())
        return out

    def as_dict(self) -> dict:
        return {"layer": self.layer, "class": self.module_class, "operator_classes": sorted(self.classes),
                "covered_by": self.covered_by(), "refused": [r.line() for r in self.refusals]}


# -- recognising modules by structure ------------------------------------------------------------------------
def moe_router(m) -> nn.Module | None:
    """A MoE block's top-k router: its `gate` (Qwen, Mixtral, HunYuan) or `router` (Jamba, Granite-MoE), a module
    with top_k and a weight of its own or in a linear child `wg` (HunYuan); None for any other module."""
    for n in ("gate", "router"):
        r = getattr(m, n, None)
        if isinstance(r, nn.Module) and hasattr(r, "top_k") and router_weight(r) is not None:
            return r
    return None


# the names routers give the linear that holds their weight, where they hold none themselves
ROUTER_LINEAR_NAMES = ("wg", "gate")  # HunYuan, AFMoE


def router_weight(router: nn.Module) -> torch.Tensor | None:
    """The router's [experts, hidden] weight: its own, or that of its linear child without a bias
    (ROUTER_LINEAR_NAMES)."""
    w = getattr(router, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    linear = next((c for c in (getattr(router, n, None) for n in ROUTER_LINEAR_NAMES) if isinstance(c, nn.Linear)),
                  None)
    return linear.weight if linear is not None and linear.bias is None else None


SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")  # Qwen2-MoE, DeepSeek-style, HunYuan


def shared_expert_name(m) -> str | None:
    """The MoE block's child that runs on every token beside the routed experts, or None."""
    return next((n for n in SHARED_EXPERT_NAMES if isinstance(getattr(m, n, None), nn.Module)), None)


def seeded_copy(module: nn.Module, seed: int = 0) -> nn.Module:
    """A copy of the module (on the CPU where it is on the meta device) whose every floating parameter and buffer
    holds seeded values, its other buffers zero where the meta device left them unset: a probe reads what the
    module's forward computes, not what its weights happen to be (a generated model's zero bias, ones norm)."""
    meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    probe = copy.deepcopy(module)
    if meta:
        probe = probe.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*probe.parameters(), *probe.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
            elif meta:
                t.zero_()
    return probe


def _expert_vectors(module: nn.Module, experts: int, recurse: bool, skip=None) -> list[tuple[str, torch.Tensor]]:
    """The module's floating tensors (parameters and buffers, other than `skip`) with one element per expert."""
    return [(n, t) for n, t in [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
            if t is not skip and t.is_floating_point() and t.numel() == experts and t.dim() <= 2]


def router_bias(router: nn.Module) -> torch.Tensor | None:
    """The router's per-expert selection bias (DeepSeek-V3's e_score_correction_bias, wherever the router keeps
    it: a buffer of its own or of a child): its one floating tensor, other than the weight and the bias its logits
    add (router_logit_bias_name), with one element per expert; None where it has none or several."""
    found = _selection_vectors(router)
    return found[0][1].reshape(-1) if len(found) == 1 else None


def _selection_vectors(router: nn.Module) -> list[tuple[str, torch.Tensor]]:
    w, added = router_weight(router), router_logit_bias_name(router)
    return [(n, t) for n, t in _expert_vectors(router, w.shape[0], True, skip=w) if n != added]


_LOGIT_BIAS_READINGS: dict[tuple, str | None] = {}


def router_logit_bias_name(router: nn.Module) -> str | None:
    """The name of the router's per-expert vector that its logits add, x W^T + b (a router linear with a bias:
    GPT-OSS's), read from its own forward on a seeded copy: the logits it returns are that linear's and not the
    bare product; None where its logits add none (a selection bias only chooses, it is not in the logits). One
    reading per router class and parameter shapes: the selection-bias readings ask for it again."""
    key = _module_key(router)
    if key not in _LOGIT_BIAS_READINGS:
        _LOGIT_BIAS_READINGS[key] = _read_logit_bias(router)
    return _LOGIT_BIAS_READINGS[key]


def _read_logit_bias(router: nn.Module) -> str | None:
    probe = seeded_copy(router).to(device="cpu", dtype=torch.float32)
    w = router_weight(probe)
    found = _expert_vectors(probe, w.shape[0], False, skip=w)
    if not found or not isinstance(getattr(probe, "weight", None), torch.Tensor):
        return None
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            out = probe(x)
    except Exception:  # noqa: BLE001 - a router that takes more than the rows (a handed bias) adds none here
        return None
    logits = out[0] if isinstance(out, tuple) and out else out
    if not isinstance(logits, torch.Tensor) or logits.shape != (8, w.shape[0]):
        return None

    def near(b):
        with torch.no_grad():
            y = F.linear(x, w, b).float()
        return torch.allclose(logits.float(), y, rtol=1e-3, atol=1e-4 * float(y.abs().max()))

    return next((n for n, b in found if near(b.reshape(-1)) and not near(None)), None)


def handed_bias(block: nn.Module) -> torch.Tensor | None:
    """A selection bias the MoE block holds itself and hands its router's forward (MiniMax-M2, HunYuan-V3: the
    router takes (hidden_states, e_score_correction_bias)): the block's one floating tensor of its own with one
    element per expert; None where its router holds its own bias or takes no second argument."""
    name = _handed_bias_name(block)
    return None if name is None else getattr(block, name).reshape(-1)


def _handed_bias_name(block: nn.Module) -> str | None:
    router = moe_router(block)
    if router is None or router_bias(router) is not None or not _takes_second_argument(router):
        return None
    found = _expert_vectors(block, router_weight(router).shape[0], False)
    return found[0][0] if len(found) == 1 else None


def routing_bias_name(block: nn.Module) -> str | None:
    """Where the selection bias of a MoE block's routing lives, as a dotted name under the block: in its router
    (`gate.e_score_correction_bias`), else on the block itself where it hands it to the router's forward. Read
    once when the block is wrapped, so that its forward finds the bias without searching."""
    router = moe_router(block)
    if router is None:
        return None
    own = _selection_vectors(router)
    if len(own) == 1:
        return f"{next(n for n, c in block.named_children() if c is router)}.{own[0][0]}"
    return _handed_bias_name(block)


def block_routing_bias(block: nn.Module) -> torch.Tensor | None:
    """The selection bias a MoE block's routing uses: its router's own, else the one the block hands it."""
    name = routing_bias_name(block)
    return None if name is None else operator.attrgetter(name)(block).reshape(-1)


def _takes_second_argument(router: nn.Module) -> bool:
    try:
        params = list(inspect.signature(router.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 and positional[1].default is inspect.Parameter.empty


GROUP_FIELDS = ("n_group", "num_group", "num_expert_group")  # how many groups the experts are split in
TOPK_GROUP_FIELDS = ("topk_group", "num_topk_group")  # how many of them a token keeps
SCALE_FIELDS = ("routed_scaling_factor", "router_scaling_factor", "route_scale")  # route_scale: AFMoE


def _number(obj, names) -> float | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def _routing_candidates(router: nn.Module, cfg, biased: bool) -> list[Routing]:
    """Every rule the router could compute, from what it and the config hold: a rule's parameters are read here,
    which of them it computes is read from its forward (router_routing)."""
    experts = router_weight(router).shape[0]
    groups = [(1, 1)]
    g, k = _number(router, GROUP_FIELDS) or _number(cfg, GROUP_FIELDS), \
        _number(router, TOPK_GROUP_FIELDS) or _number(cfg, TOPK_GROUP_FIELDS)
    if g and k and 1 < int(g) and experts % int(g) == 0 and int(k) < int(g):  # all groups kept: no grouping
        groups.append((int(g), int(k)))
    scales = {1.0} | {float(v) for v in (_number(router, SCALE_FIELDS), _number(cfg, SCALE_FIELDS))
                      if v is not None and v > 0}
    # groups scored by their best expert, as many kept as the top-k or more, keep every top-k expert's group: the
    # same choice as no grouping on every input (DeepSeek-V2 at topk_group >= top-k), read as that
    return [Routing(score, renormalize, bias, gr, kg, scale, on_logits)
            for score in SCORES for renormalize in (True, False) for bias in ({False, biased})
            for gr, kg in groups for scale in sorted(scales) for on_logits in ({False, bias})
            if gr == 1 or bias or kg < router.top_k]


def _tied_at(values: torch.Tensor, k: int) -> bool:
    """Whether some row's k-th and (k+1)-th largest values are equal: which experts a top-k keeps there is the
    tie-break's choice, not the rule's (a router's sigmoid scores all 1.0 on the probe's widest rows)."""
    if values.shape[-1] <= k:
        return False
    top = values.topk(k + 1, dim=-1).values
    return bool((top[:, k - 1] == top[:, k]).any())


def _router_on_rows(router: nn.Module, rows: torch.Tensor, extra: tuple) -> tuple | None:
    """The router's (logits, top-k weights, top-k ids) on rows [T, H], handed to it as [T, H] or, where its forward
    takes only that, as one batch [1, T, H] (AFMoE's unpacks three dimensions); None where it runs on neither or
    returns something else."""
    for given in (rows, rows[None]):
        try:
            with torch.no_grad():
                out = router(given, *extra)
        except Exception:  # noqa: BLE001 - a router that does not run on the probe is not read
            continue
        ok = isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) and t.dim() for t in out)
        return out if ok else None
    return None


def router_routing(router: nn.Module, cfg=None, handed: torch.Tensor | None = None) -> Routing | None:
    """What the router computes (tic.harness.kernels.routing), read from its own forward on seeded rows: the one
    candidate rule (_routing_candidates) whose experts and weights the router gives on every probe; None where
    none or several do, or the forward does not return (logits, top-k weights, top-k ids) (a router the MoE
    wrapper does not compute: PhiMoE's sparsemixer). The forward runs on a copy whose every floating parameter and
    buffer is seeded: a term that starts at zero (a selection bias before training) must show. handed: the bias
    the block hands the router's forward (handed_bias), given to it seeded too."""
    # on the CPU in float32: a bf16 router's logits at the small scales below meet exact ties among many experts,
    # which its top-k on the GPU breaks otherwise than `select` (read so, a Qwen3-MoE router fit no rule)
    probe = seeded_copy(router).to(device="cpu", dtype=torch.float32)
    w, bias = router_weight(probe), router_bias(probe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, w.shape[1], generator=g)
    extra = ()
    if handed is not None:
        bias = torch.randn(handed.shape, generator=g)
        extra = (bias,)
    top_k = probe.top_k
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:  # e.g. a config without the count
        return None
    fits = _routing_candidates(probe, cfg, bias is not None)
    # Seeded weights make a peaked softmax whose top-k already sums to about one, where rules agree: the rows
    # are scaled down, each scale keeping the rules that fit it, until one is left (no further: at a tiny scale
    # a bf16 router meets exact ties, which its own top-k may break otherwise).
    for scale in (1.0, 0.1, 0.01, 0.001):
        out = _router_on_rows(probe, x * scale, extra)
        if out is None:
            return None
        logits, got, ids = (t.reshape(-1, t.shape[-1]) for t in out)
        ids = ids.long()
        if ids.shape[-1] != top_k:
            return None
        order = ids.argsort(-1)
        got = got.float().gather(-1, order)
        ids = ids.gather(-1, order)

        def fits_here(rule: Routing) -> bool:
            s = routing_scores(logits.float(), rule)
            chosen_on = choice(s, logits, bias, rule)
            if _tied_at(chosen_on, top_k):  # saturated scores (sigmoid at 1.0): this scale cannot tell
                return True
            if not torch.equal(select(chosen_on, top_k, rule).sort(-1).values, ids):
                return False
            return torch.allclose(got, routing_weights(s, ids, rule), rtol=1e-2, atol=1e-4)

        fits = [r for r in fits if fits_here(r)]
        if len(fits) <= 1:
            return fits[0] if fits else None
    return None


def router_renormalizes(router: nn.Module) -> bool | None:
    """A softmax top-k router's rule: its weights renormalised (True, Qwen's) or as they are (False, Jamba's); None
    for any other router (router_routing reads those)."""
    rule = router_routing(router)
    return rule.renormalize if rule is not None and rule.plain else None


def expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' weights as the MoE wrappers take them: [gate; up] as [E, 2I, H] and down as [E, H, I].
    transformers stores some as (in, out) instead (its experts flag `is_transposed`, e.g. Aria's); those come back
    as transposed views of the parameters. Otherwise the parameters themselves."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):
        return gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


def few_experts(experts: nn.Module, n: int, seed: int = 0) -> nn.Module:
    """A float32 copy of the experts module that holds only its first n experts, every floating parameter and buffer
    seeded: one expert's computation does not depend on how many there are, and a real model's experts take
    gigabytes. Counts the module keeps under EXPERT_COUNT_NAMES follow."""
    total = experts.gate_up_proj.shape[0]
    probe = copy.copy(experts)
    probe._parameters, probe._buffers = {}, {}
    probe._modules = {k: copy.deepcopy(v) for k, v in experts._modules.items()}
    for k, v in vars(experts).items():  # the copy runs none of the hooks a caller put on the model's module
        if k.endswith("hooks") and isinstance(v, dict):
            setattr(probe, k, type(v)())
    g = torch.Generator().manual_seed(seed)

    def fresh(t):
        shape = (n, *t.shape[1:]) if t.dim() and t.shape[0] == total else t.shape
        return torch.randn(shape, generator=g) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)

    for k, v in experts._parameters.items():
        probe._parameters[k] = None if v is None else nn.Parameter(fresh(v), requires_grad=False)
    for k, v in experts._buffers.items():
        probe._buffers[k] = None if v is None else fresh(v)
    for k in EXPERT_COUNT_NAMES:
        if getattr(experts, k, None) == total:
            setattr(probe, k, n)
    return probe.float()


_SWIGLU_READINGS: dict[tuple, bool | None] = {}


def _routed_rows(g: torch.Generator, rows: int, hidden: int, experts: int, k: int):
    """An experts probe's input: seeded rows, each routed to k distinct experts of the first `experts` with
    weights in [0, 1)."""
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])
    return x, ids, torch.rand(rows, k, generator=g)


def _module_key(module: nn.Module) -> tuple:
    """What a probe's reading of a module (on seeded values, not its own) depends on: the class, its parameters'
    shapes and dtypes, its plain settings. A model's layers share their readings."""
    return (type(module), tuple((k, tuple(v.shape), v.dtype) for k, v in module.named_parameters()),
            tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)))))


_PER_TOKEN_READINGS: dict[tuple, bool] = {}


def experts_act_per_token(experts: nn.Module) -> bool:
    """Whether the experts' own forward on (rows, top-k ids, top-k weights) computes each token's row from that
    token's row, ids and weights alone (up to rounding), read on a seeded float32 copy of a few experts: then
    running it one token at a time computes the model's function, batch-invariant by construction (GPT-OSS's
    clamped SwiGLU on interleaved gate and up columns, with biases). A forward that mixes tokens (a capacity
    limit, a batch statistic) or does not run on the probe reads False."""
    key = _module_key(experts)
    if key not in _PER_TOKEN_READINGS:
        _PER_TOKEN_READINGS[key] = _read_per_token(experts)
    return _PER_TOKEN_READINGS[key]


def _read_per_token(experts: nn.Module) -> bool:
    total = experts.gate_up_proj.shape[0]
    n = min(4, total)
    probe = few_experts(experts, n)
    g = torch.Generator().manual_seed(4)
    rows, k = 6, min(2, n)
    # the hidden size is one of the weights' feature sizes, whichever way they are stored: the one the forward takes
    for hidden in sorted({*experts.gate_up_proj.shape[1:], *experts.down_proj.shape[1:]}):
        x, ids, weights = _routed_rows(g, rows, hidden, n, k)
        try:
            with torch.no_grad():
                whole = probe(x, ids, weights)
                each = torch.cat([probe(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(rows)])
        except Exception:  # noqa: BLE001 - a forward that does not take (rows, ids, weights) of this width
            continue
        return isinstance(whole, torch.Tensor) and whole.shape == x.shape and bool(whole.abs().max() > 0) \
            and torch.allclose(whole, each, rtol=1e-4, atol=1e-5 * float(whole.abs().max()))
    return False


def experts_compute_swiglu(experts: nn.Module) -> bool | None:
    """Whether the experts' own forward computes what the MoE wrappers compute from expert_weights: per token, the
    sum over its top-k slots of weight x down(silu(gate x) * up x). Read on a seeded float32 copy of a few experts,
    so a layout the wrappers would misread (interleaved gate and up columns, a bias, a norm after each expert) shows
    in the values whatever flags the class declares; None where the forward does not run on (rows, ids, weights).
    One reading per experts class and parameter shapes: a model's MoE layers share it."""
    key = _module_key(experts)
    if key not in _SWIGLU_READINGS:
        _SWIGLU_READINGS[key] = _read_swiglu(experts)
    return _SWIGLU_READINGS[key]


def _read_swiglu(experts: nn.Module) -> bool | None:
    n = min(3, experts.gate_up_proj.shape[0])
    probe = few_experts(experts, n)
    gate_up, down = expert_weights(probe)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2] \
            or down.shape[1] != gate_up.shape[2]:
        return False
    x, ids, weights = _routed_rows(torch.Generator().manual_seed(2), 6, gate_up.shape[2], n, min(2, n))
    try:
        with torch.no_grad():
            got = probe(x, ids, weights)
    except Exception:  # noqa: BLE001 - experts whose forward does not take (rows, ids, weights) are not read
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None
    want = moe_experts_ref(x.double(), weights.double(), ids, gate_up.double(), down.double())
    return bool(torch.allclose(got.double(), want, rtol=1e-3, atol=1e-4 * float(want.abs().max())))


def is_moe_block(m) -> bool:
    return moe_router(m) is not None and hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")


def _linears(m, *names) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in names)


def is_gated_mlp(m) -> bool:
    """gate, up and down projections, gate and up separate or as one fused [gate | up] linear (Phi-3, GLM)."""
    return _linears(m, "down_proj") and (_linears(m, "gate_proj", "up_proj") or _linears(m, "gate_up_proj"))


def output_projection_name(m) -> str | None:
    """An attention's output projection: o_proj, or dense beside q/k/v projections (Phi) or GPT-NeoX's fused
    query_key_value."""
    if isinstance(getattr(m, "o_proj", None), nn.Linear):
        return "o_proj"
    if isinstance(getattr(m, "dense", None), nn.Linear) and (_linears(m, "q_proj", "k_proj", "v_proj")
                                                              or _linears(m, "query_key_value")):
        return "dense"
    return None


def head_dim_of(attn) -> int:
    return int(getattr(attn, "head_dim", None) or attn.head_size)  # head_size: GPT-NeoX


# the names decoder layers give their attention: self_attn (most), attention (GPT-NeoX), self_attention (Falcon)
ATTENTION_NAMES = ("self_attn", "attention", "self_attention")


def attention_name(layer) -> str | None:
    """A decoder layer's token mixer: its attention (ATTENTION_NAMES), or a Mamba-1 or Mamba-2 mixer in the
    attention's place (Jamba's mamba layers, Bamba's)."""
    for n in ATTENTION_NAMES:
        if is_attention(getattr(layer, n, None)) or mla.is_mla_attention(getattr(layer, n, None)):
            return n
    for n, c in layer.named_children():
        if mamba_modules.is_scan_mixer(c):
            return n
    return "self_attn" if hasattr(layer, "self_attn") else None


def mlp_name(layer) -> str | None:
    """A decoder layer's MLP (or MoE) child: mlp, feed_forward (Jamba) or block_sparse_moe (Granite-MoE)."""
    return next((n for n in ("mlp", "feed_forward", "block_sparse_moe") if isinstance(getattr(layer, n, None),
                                                                                    nn.Module)), None)


def is_attention(m) -> bool:
    """q, k, v and o projections, q/k/v separate or as one fused [q | k | v] linear (Phi-3)."""
    return m is not None and _linears(m, output_projection_name(m) or "o_proj") and \
        (_linears(m, "q_proj", "k_proj", "v_proj") or _linears(m, "qkv_proj") or _linears(m, "query_key_value")) \
        and (hasattr(m, "head_dim") or hasattr(m, "head_size")) and hasattr(m, "layer_idx")


def mlp_activation(m):
    """A gated MLP's activation module (transformers names it act_fn, or activation_fn in Phi-3 and GLM)."""
    return getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)


def is_decoder_layer(m) -> bool:
    """An attention (self_attn, or another of ATTENTION_NAMES), an mlp and a norm, the norm of any name
    (norm_roles reads what each does)."""
    mixes = hasattr(m, "self_attn") or any(is_attention(getattr(m, n, None)) for n in ATTENTION_NAMES[1:]) \
        or any(mamba_modules.is_scan_mixer(c) for c in m.children())
    return mixes and mlp_name(m) is not None and \
        (hasattr(m, "input_layernorm") or hasattr(m, "post_attention_layernorm")
         or any(is_norm(c) for c in m.children()))


ACTIVATIONS = {"mlp:silu_and_mul": F.silu, "mlp:gelu_tanh_and_mul": lambda x: F.gelu(x, approximate="tanh")}


# the activation names vLLM 0.26's get_act_fn answers with torch's own function on CUDA (the others: its own kernels)
# config names vLLM runs as torch's function, or (relu2) through a kernel of its own that gives torch's bits
TORCH_ACTIVATION_NAMES = {"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish", "relu2"}


def plain_mlp_parts(m) -> tuple[str, str, str] | None:
    """(up, down, activation child) of an ungated MLP: exactly two linears, the first widening what the second
    narrows back, and one other child (the activation; dropouts of probability 0 aside); None for anything else."""
    kids = {n: c for n, c in m.named_children() if not (isinstance(c, nn.Dropout) and float(c.p) == 0.0)}
    linears = [n for n, c in kids.items() if isinstance(c, nn.Linear)]
    others = [n for n in kids if n not in linears]
    if len(linears) != 2 or len(others) != 1 or _linears(m, "gate_proj") or hasattr(m, "experts"):
        return None
    for up, down in (linears, linears[::-1]):
        u, d = kids[up], kids[down]
        if u.out_features == d.in_features and u.in_features == d.out_features:
            return up, down, others[0]
    return None


def plain_activation(act) -> str | None:
    """The ungated activation (autograd.PLAIN_ACTS: torch's functions, which vLLM's models also call on the GPU for
    these names) `act` computes bit for bit on a CPU probe (gelu_new's formula is not torch's tanh GELU, and is
    refused), or None."""
    probe = _activation_probe(act)
    if probe is None:
        return None
    x, y = probe
    return next((n for n, fn in PLAIN_ACTS.items() if y.shape == x.shape and torch.equal(y, fn(x))), None)


def _activation_probe(act) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, act(x)) on a CPU probe, or None for an activation that does not run on one (not one the wrappers
    know)."""
    if act is None:
        return None
    x = probe_input(16).reshape(-1) * 2
    try:
        with torch.no_grad():
            return x, act(x)
    except Exception:  # noqa: BLE001
        return None


def acts_per_row(act) -> bool:
    """Whether an activation module computes each row of its input from that row alone (up to rounding), on a
    CPU probe: then running it one row at a time computes the model's function, row-invariant by construction."""
    if not isinstance(act, nn.Module):
        return False
    act = seeded_copy(act)  # real numbers on the CPU, also for a model on the meta device (C0)
    x = probe_input(16).reshape(4, -1) * 2
    p = next(act.parameters(), None)
    x = x.to(p.dtype) if p is not None and p.is_floating_point() else x
    try:
        with torch.no_grad():
            whole = act(x)
            rows = torch.cat([act(r) for r in x.split(1, dim=0)])
    except Exception:  # noqa: BLE001 - one that does not run on the probe (or on the meta device)
        return False
    return whole.shape == x.shape and torch.allclose(whole.float(), rows.float(), rtol=1e-3, atol=1e-5)


def activation_variant(act) -> str | None:
    """The registered gated-MLP class whose activation `act` (an HF act_fn module) computes, on a CPU probe."""
    probe = _activation_probe(act)
    if probe is None:
        return None
    x, y = probe[0], probe[1].float()
    for name, fn in ACTIVATIONS.items():
        if y.shape == x.shape and torch.allclose(y, fn(x), rtol=1e-5, atol=1e-6):
            return name
    return None


def _act_field(cfg) -> tuple[str, object]:
    for key in ("hidden_activation", "hidden_act"):
        if getattr(cfg, key, None) is not None:
            return key, getattr(cfg, key)
    return "hidden_act", None


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]


def rotary_per_layer_type(rotary: nn.Module) -> bool:
    """Whether an HF rotary module holds one table per layer type (its forward takes the layer type)."""
    return "layer_type" in inspect.signature(type(rotary).forward).parameters


def _rotary_probe(model: nn.Module, rotary: nn.Module):
    """The modeling module's own `apply_rotary_pos_emb` on seeded q, k and cos|sin rows of the table's width, in
    HF's layout (q [B, H, T, D], cos and sin [B, T, R] laid out as the rotary module lays them out): (the attention
    module, its q and k, the inputs, the table [T, R], the positions), or None when there is no such function to
    probe or it takes another signature."""
    attn = next((m for m in model.modules() if is_attention(m)), None)
    apply = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None) if attn else None
    freqs = getattr(rotary, "inv_freq", None)
    if apply is None or not isinstance(freqs, torch.Tensor) or freqs.dim() != 1:
        return None
    d, half, t = head_dim_of(attn), int(freqs.shape[0]), 5
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, t, d, generator=g), torch.randn(1, 2, t, d, generator=g)
    c, s = torch.randn(t, half, generator=g), torch.randn(t, half, generator=g)
    layout = rotary_output_layout(rotary)
    try:
        got = apply(q, k, spread_angles(c, layout)[None], spread_angles(s, layout)[None])
    except Exception:  # noqa: BLE001 - another signature: nothing to compare here, C2 compares the forward
        return None
    return attn, got, (q, k), torch.cat([c, s], -1), torch.arange(t)


def _probe_matches(probe, rotate) -> bool:
    _, got, inputs, table, positions = probe
    want = [rotate(x[0].transpose(0, 1), positions, table).transpose(0, 1)[None] for x in inputs]
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))


ROTARY_STYLES = (("neox", rotate_neox), ("interleaved", rotate_interleaved),
                 ("neox_reversed", lambda x, pos, table: rotate_neox(x, pos, sin_negated(table))),
                 ("interleaved_reversed", lambda x, pos, table: rotate_interleaved(x, pos, sin_negated(table))))


def rotary_style(model: nn.Module, rotary: nn.Module) -> tuple[str | None, str | None]:
    """(style, problem) of the model's rotary, read by computation against the wrappers' rotations over the table's
    first R head features, the rest passed through: "neox" (rope.rotate_neox) or "interleaved"
    (rope.rotate_interleaved), either turned by minus each angle ("_reversed": the table's sin negated); (None,
    None) when there is nothing to probe (C2's fidelity check still compares the whole forward); (None, why) for a
    rotary that is none of them."""
    probe = _rotary_probe(model, rotary)
    if probe is None:
        return None, None
    for style, rotate in ROTARY_STYLES:
        if _probe_matches(probe, rotate):
            return style, None
    attn, d, rot = probe[0], probe[2][0].shape[-1], probe[3].shape[-1]
    span = "the whole head" if rot == d else f"{rot} of {d} head features"
    return None, (f"a rotary applied otherwise than neox or interleaved pairs (either way round) over {span} "
                  f"({type(attn).__module__}.apply_rotary_pos_emb)")


def attention_layer_type(m: nn.Module, cfg) -> str | None:
    """The layer type of an attention module: its own `layer_type` (Gemma-3) or `attention_type` (OLMo-3), else
    the config's layer_types at its layer_idx."""
    for attr in ("layer_type", "attention_type"):
        if isinstance(getattr(m, attr, None), str):
            return getattr(m, attr)
    types_, i = getattr(cfg, "layer_types", None), getattr(m, "layer_idx", None)
    return types_[i] if types_ and isinstance(i, int) and 0 <= i < len(types_) else None


def attention_window(m, cfg) -> int | None:
    """The sliding window of one attention module: None on a layer whose type is full attention (EXAONE-4 keeps
    the config's window on every attention and slides only where its layer type says so), else its own
    `sliding_window` (None on a full layer) where it has one, else the config's, which then applies to every
    layer (Mistral)."""
    if attention_layer_type(m, cfg) == "full_attention" or getattr(m, "is_sliding", None) is False:
        return None
    if hasattr(m, "sliding_window"):
        return m.sliding_window
    return getattr(cfg, "sliding_window", None)


def attention_softcap(m, cfg) -> float | None:
    return getattr(m, "attn_logit_softcapping", getattr(cfg, "attn_logit_softcapping", None))


def attention_clip(m, cfg) -> float | None:
    """transformers' OLMoE clamps q, k and v to +-clip_qkv after the q/k norms (its config's field)."""
    return getattr(getattr(m, "config", cfg), "clip_qkv", None)


# -- reading a model's coverage --------------------------------------------------------------------------------
def _read_norm(cov: LayerCoverage, name: str, norm) -> None:
    """The norm's variant and, where its forward runs another epsilon than the module holds under its usual names,
    that epsilon (a reading the wrapper takes): norms.norm_reading."""
    variant, eps = norm_reading(norm)
    if variant is None:
        cov.refusals.append(Refusal(name, type(norm).__name__, "a norm computing neither w * x_hat nor "
                                    "(1 + w) * x_hat (RMSNorm), torch's LayerNorm (with w or w + 1) nor a LayerNorm "
                                    "written out in float32, the norms the wrappers implement"))
        return
    if eps is None:
        cov.refusals.append(Refusal(name, type(norm).__name__, "a norm whose epsilon is neither the one it holds "
                                    f"({norm_eps(norm):g}) nor a usual one: its output on rows of small mean square "
                                    "matches none"))
        return
    cov.classes[variant] = (None, None)
    cov.variants[name] = variant
    if eps != norm_eps(norm):
        cov.readings.setdefault(name, {})["eps"] = eps


@contextlib.contextmanager
def _attention_function(attn: nn.Module, name: str):
    """The attention's config set to run attention function `name` for the duration of a probe, then restored."""
    config = getattr(attn, "config", None)
    kept = getattr(config, "_attn_implementation", None)
    try:
        if config is not None:
            config._attn_implementation = name
        yield
    finally:
        if config is not None:
            config._attn_implementation = kept


class _Split(Exception):
    """Raised by the layout probe's attention function with the q, k and v the attention hands it."""

    def __init__(self, qkv):
        super().__init__()
        self.qkv = qkv


QKV_PROBE = "tic_qkv_layout_probe"  # the attention function (transformers' AttentionInterface) of the probe


def _raise_split(module, query, key, value, *args, **kwargs):
    raise _Split((query, key, value))


def _handed_qkv(attn: nn.Module, h: torch.Tensor, width: int, device):
    """The q, k and v the attention's own forward hands its attention function, on rows `h` with an identity rotary
    table `width` wide (cos 1, sin 0: exact) on `device`: the probe's attention function stops the forward there.
    None where the forward does not run so."""
    from transformers import AttentionInterface

    AttentionInterface.register(QKV_PROBE, _raise_split)
    cos, sin = torch.ones(1, 1, width, device=device), torch.zeros(1, 1, width, device=device)
    try:
        with torch.no_grad(), _attention_function(attn, QKV_PROBE):
            attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
    except _Split as split:
        return split.qkv  # each [batch, heads, tokens, head size]
    except Exception:  # noqa: BLE001 - a forward this probe cannot drive
        return None
    return None


def _identity(x, *args, **kwargs):
    return x


def rotary_widths(attn: nn.Module) -> tuple[int, ...]:
    """The widths a probe's rotary table is tried at: the head's, then the rotary part's, for a forward that slices
    the head itself (Persimmon's rotary_ndims, from partial_rotary_factor)."""
    d, config = head_dim_of(attn), getattr(attn, "config", None)
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") \
        or getattr(config, "partial_rotary_factor", None) or 1.0
    return tuple(dict.fromkeys((d, int(d * float(factor)))))


def fused_qkv_layout(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For an attention with one fused query_key_value linear: which of its output features each element of q, k
    and v is (three index tensors of heads * head_dim, head-major), read from the attention's own forward
    (_handed_qkv) with its linear's output replaced by each feature's index, one token. On the meta device too
    (C0). None where that forward does not run on the probe."""
    lin = attn.query_key_value
    dev = torch.device("cpu") if lin.weight.is_meta else lin.weight.device  # the indices must be real numbers
    codes = torch.arange(lin.out_features, dtype=torch.float32, device=dev).reshape(1, 1, -1)
    hook = lin.register_forward_hook(lambda mod, args, out: codes)
    h = torch.zeros(1, 1, lin.in_features, device=lin.weight.device, dtype=lin.weight.dtype)
    # q/k norms between the split and the attention (Persimmon's) would mix the codes: they hand them on as they are
    norms = [getattr(attn, n) for n in qk_norm_names(attn) or () if isinstance(getattr(attn, n, None), nn.Module)]
    own = [norm.__dict__.get("forward") for norm in norms]  # a forward already set on the module (a wrapper's)
    for norm in norms:
        norm.forward = _identity
    try:
        for width in rotary_widths(attn):
            qkv = _handed_qkv(attn, h, width, dev)
            if qkv is not None:
                return tuple(t[0, :, 0, :].reshape(-1).to("cpu", torch.long) for t in qkv)
        return None
    finally:
        hook.remove()
        for norm, forward in zip(norms, own):
            if forward is None:
                del norm.forward
            else:
                norm.forward = forward


def value_reading(attn: nn.Module) -> tuple[int, float] | None:
    """For an attention whose v_proj is not as wide as its k_proj (values of another head size, MiMo-V2-Flash's):
    (the value head size, the constant its forward scales the values by), read from the attention's own forward
    (_handed_qkv) with each projection's output replaced by seeded CPU rows, one token. None for an attention whose
    values are as wide as its keys, or whose forward does not run on the probe or hands the values on otherwise
    than scaled."""
    if not _linears(attn, "q_proj", "k_proj", "v_proj") or attn.v_proj.out_features == attn.k_proj.out_features:
        return None
    g = torch.Generator().manual_seed(5)
    rows = {n: torch.rand(1, 1, getattr(attn, n).out_features, generator=g) + 0.5 for n in ("q_proj", "k_proj",
                                                                                           "v_proj")}
    hooks = [getattr(attn, n).register_forward_hook(lambda mod, args, out, r=r: r) for n, r in rows.items()]
    w = attn.q_proj.weight
    h = torch.zeros(1, 1, attn.q_proj.in_features, device=w.device, dtype=w.dtype)  # what the projections take
    try:
        qkv = _handed_qkv(attn, h, head_dim_of(attn), "cpu")
    finally:
        for hook in hooks:
            hook.remove()
    if qkv is None:
        return None
    v = qkv[2]  # [batch, kv heads, tokens, value head size]
    ratio = v.transpose(1, 2).reshape(-1).float() / rows["v_proj"].reshape(-1)
    if v.numel() != rows["v_proj"].numel() or not torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-2):
        return None
    return int(v.shape[-1]), float(ratio[0])


# the names attentions give a linear whose output gates theirs before the output projection (Laguna, AFMoE, LFM3)
OUTPUT_GATE_NAMES = ("g_proj", "gate_proj")
OUTPUT_GATE_PROBE = "tic_output_gate_probe"  # the attention function of output_gate_reading's probe


def _pass_seeded_output(module, query, key, value, *args, **kwargs):
    """An attention function that returns seeded rows [B, T, H, D] (no attention) and keeps them on the module."""
    g = torch.Generator().manual_seed(7)
    b, h, t, _ = query.shape
    out = torch.rand(b, t, h, value.shape[-1], generator=g).to(query.dtype) + 0.5
    module._tic_probe_output = out
    return out, None


def output_gate_reading(attn: nn.Module) -> tuple[str, str, bool] | None:
    """For an attention with a gate linear (OUTPUT_GATE_NAMES) on its input: (its name, the function, per head), where
    the attention's own forward multiplies its attention output by function(gate(x)) (autograd.OUTPUT_GATES:
    sigmoid, softplus) before the output projection, per element or one gate per head; read on a seeded copy, whose
    attention function returns seeded rows, against what the output projection is handed. None where there is no
    such linear, or the forward does something else with it."""
    from transformers import AttentionInterface

    name = next((n for n in OUTPUT_GATE_NAMES if isinstance(getattr(attn, n, None), nn.Linear)), None)
    out_name = output_projection_name(attn) or "o_proj"
    if name is None or not isinstance(getattr(attn, out_name, None), nn.Linear):
        return None
    AttentionInterface.register(OUTPUT_GATE_PROBE, _pass_seeded_output)
    probe, d = seeded_copy(attn), head_dim_of(attn)
    w = getattr(probe, name).weight
    h = torch.randn(1, 2, w.shape[1], generator=torch.Generator().manual_seed(3)).to(w.dtype)
    seen: dict = {}
    hooks = [getattr(probe, name).register_forward_hook(lambda mod, args, out: seen.setdefault("gate", out)),
             getattr(probe, out_name).register_forward_pre_hook(lambda mod, args: seen.setdefault("into", args[0]))]
    cos, sin = torch.ones(1, 2, d), torch.zeros(1, 2, d)
    try:
        with torch.no_grad(), _attention_function(probe, OUTPUT_GATE_PROBE):
            probe(hidden_states=h, position_embeddings=(cos.to(w.dtype), sin.to(w.dtype)), attention_mask=None)
    except Exception:  # noqa: BLE001 - a forward this probe cannot drive
        return None
    finally:
        for hook in hooks:
            hook.remove()
    out = getattr(probe, "_tic_probe_output", None)
    if out is None or "gate" not in seen or "into" not in seen:
        return None
    for function, per_head in ((f, p) for f in OUTPUT_GATES for p in (False, True)):
        want = gate_output_ref(seen["gate"], out.reshape(*out.shape[:2], -1), function, per_head)
        if want is not None and want.shape == seen["into"].shape and \
                torch.allclose(want.float(), seen["into"].float(), rtol=1e-5, atol=1e-6):
            return name, function, per_head
    return None


class _Consumed(Exception):
    """Raised inside an attention's forward at its first operator on the position embeddings."""


def applies_rotary(attn: nn.Module) -> bool | None:
    """Whether an attention's own forward reads the (cos, sin) it is handed: False for a layer without position
    embeddings (NoPE), True as soon as one of its operators takes them, None where its forward cannot run here
    (the wrappers then apply the rotary, and C2's fidelity check judges). Two tokens on the module's own device
    (the meta device at C0), eager attention; the forward stops at the first operator on cos or sin."""
    if "position_embeddings" not in inspect.signature(type(attn).forward).parameters:
        return False
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    # the rows' device and dtype from the input projection: a model may keep other parameters in float32 (Flint's
    # sinks, its attention's first parameter); rows of another dtype make the probe fail, and read as rotary
    proj = next(getattr(attn, n) for n in ("q_proj", "qkv_proj", "query_key_value")
                if isinstance(getattr(attn, n, None), nn.Linear))
    device, dtype, width = proj.weight.device, proj.weight.dtype, proj.in_features
    h = torch.zeros(1, 2, width, device=device, dtype=dtype)
    cos, sin = (torch.ones(1, 2, head_dim_of(attn), device=device, dtype=dtype) for _ in range(2))

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if any(t is cos or t is sin for t in tree_flatten((args, kwargs or {}))[0]):
                raise _Consumed
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad(), _attention_function(attn, "eager"), Watch():
            attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
        return False
    except _Consumed:
        return True
    except Exception:  # noqa: BLE001 - a forward this probe cannot drive: unknown
        return None


def is_no_rope(attn: nn.Module) -> bool:
    """An attention handed position embeddings that its own forward never reads (NoPE: attention:no_rope)."""
    return _takes_rope(attn) and applies_rotary(attn) is False


def query_width(attn: nn.Module, qkv_index=None) -> int | None:
    """How many features the attention's query gives as read from its modules: q_proj's outputs, or the q part of a
    fused query_key_value's layout (fused_qkv_layout); None where the modules do not say (a fused [q | k | v] is
    split by num_attention_heads, which the caller reads from the config)."""
    if _linears(attn, "q_proj"):
        return attn.q_proj.out_features
    return None if qkv_index is None else len(qkv_index[0])


def _read_head_geometry(cov: LayerCoverage, name: str, m, cfg, qkv_index) -> None:
    """The wrappers split the query into num_attention_heads heads of head_dim and hand their features to the
    output projection. A q_proj giving more (an output gate, as in Qwen3-Next) computes something else; an output
    projection taking another width cannot be joined to the heads at all: neither the model's own forward nor
    the wrappers run (e.g. a config whose head_dim * num_attention_heads is not hidden_size, for a class that
    sizes its output projection from hidden_size)."""
    d, out_name = head_dim_of(m), output_projection_name(m) or "o_proj"
    heads = getattr(cfg, "num_attention_heads", None)
    expected = heads * d if isinstance(heads, int) and not isinstance(heads, bool) else None
    width, out = query_width(m, qkv_index), getattr(m, out_name)
    if expected is not None and _linears(m, "q_proj") and width != expected:
        cov.refusals.append(Refusal(f"{name}.q_proj", type(m.q_proj).__name__, f"gives {width} features, not "
                                    f"num_attention_heads x head_dim = {expected} (a gate or heads the wrappers do "
                                    "not split)", "num_attention_heads", heads))
        return
    width = expected if expected is not None else width
    value = value_reading(m)
    if value is not None and width is not None:  # the heads hand the output projection values of their own size
        cov.classes["attention:value_head"] = ("v_head_dim", value[0])
        cov.readings.setdefault(name, {})["value"] = value
        d, width = value[0], width // head_dim_of(m) * value[0]
    if width is not None and (width % d or width != out.in_features):
        cov.refusals.append(Refusal(f"{name}.{out_name}", type(out).__name__, f"takes {out.in_features} features, "
                                    f"where the query heads give {width} (head_dim {d}): the attention's output "
                                    "does not fit its output projection", "head_dim", d))


def attention_sinks(m, cfg) -> nn.Parameter | None:
    """The attention's sinks (GPT-OSS): a parameter `sinks` with one value per query head, or None."""
    sinks, heads = getattr(m, "sinks", None), getattr(cfg, "num_attention_heads", None)
    return sinks if isinstance(sinks, nn.Parameter) and sinks.dim() == 1 and sinks.numel() == heads else None


def _read_attention(cov: LayerCoverage, name: str, m, cfg) -> None:
    kind = type(m).__name__
    sinks = attention_sinks(m, cfg)
    gate = output_gate_reading(m)
    parts = ATTENTION_PARTS | {gate[0]} if gate is not None else ATTENTION_PARTS
    _read_unused_parts(cov, name, m, "an attention", parts, ("sinks",) if sinks is not None else ())
    if gate is not None:
        cov.classes["attention:output_gate"] = (None, None)
        cov.readings.setdefault(name, {})["output_gate"] = gate
    if sinks is not None:
        cov.classes["attention:sinks"] = ("num_attention_heads", int(sinks.numel()))
    layout = None
    # ALiBi: Falcon says so in its config, Bloom's attention always takes the biases (an `alibi` argument)
    by_config = bool(getattr(cfg, "alibi", False))
    alibi = by_config or "alibi" in inspect.signature(type(m).forward).parameters
    if alibi:
        cov.refusals.append(Refusal(name, kind, "ALiBi position biases (the wrappers' attention has none)",
                                    *(("alibi", True) if by_config else ())))
    if _linears(m, "query_key_value") and not alibi:  # (the layout probe cannot drive an ALiBi forward)
        layout = fused_qkv_layout(m)
        if layout is None:
            cov.refusals.append(Refusal(f"{name}.query_key_value", type(m.query_key_value).__name__, "a fused "
                                        "query_key_value whose split into q, k and v the layout probe could not "
                                        "read from the attention's forward"))
        else:
            cov.classes["attention:qkv_fused"] = (None, None)
            cov.readings.setdefault(name, {})["qkv_index"] = layout
    _read_head_geometry(cov, name, m, cfg, layout)
    window = attention_window(m, cfg)
    if window:
        fld = "layer_types" if getattr(cfg, "layer_types", None) else "sliding_window"
        cov.classes["attention:sliding"] = (fld, window if fld == "sliding_window" else "sliding_attention")
    else:
        cov.classes["attention:full"] = (None, None)
    if attention_softcap(m, cfg) is not None:
        cov.classes["attention:softcap"] = ("attn_logit_softcapping", attention_softcap(m, cfg))
    if is_no_rope(m):
        cov.classes["attention:no_rope"] = ("layer_idx", getattr(m, "layer_idx", None))
        cov.readings.setdefault(name, {})["no_rope"] = True
    if getattr(m, "is_causal", True) is False:
        cov.refusals.append(Refusal(name, kind, "bidirectional attention (the wrappers' attention is causal)",
                                    "use_bidirectional_attention", getattr(cfg, "use_bidirectional_attention", None)))
    if attention_clip(m, cfg) is not None:
        cov.classes["attention:clip_qkv"] = ("clip_qkv", attention_clip(m, cfg))
    for a in ("q_layernorm", "k_layernorm"):  # one norm shared by the heads (Persimmon), or one per head (StableLM)
        held = getattr(m, a, None)
        if held is not None and not is_norm(held) and each_head_norms(held) is None:
            cov.refusals.append(Refusal(f"{name}.{a}", type(held).__name__, "q/k norms neither one norm nor one norm "
                                        "per head (a list of them, each on its head), read from the forward",
                                        "qk_layernorm", True))
            return
    _read_qk_norms(cov, name, m)


def _read_mla_attention(cov: LayerCoverage, name: str, m, cfg) -> None:
    """A latent attention (tic.harness.kernels.mla): its norms, its rotary layout read from its own forward, and
    what the MLA wrapper does not run (a window, a softcap, bidirectional attention) refused."""
    kind = type(m).__name__
    _read_unused_parts(cov, name, m, "a latent attention", mla.PARTS)
    for n in ("q_a_layernorm", "kv_a_layernorm"):
        if isinstance(getattr(m, n, None), nn.Module):
            _read_norm(cov, f"{name}.{n}", getattr(m, n))
    for what, value in (("a sliding window", attention_window(m, cfg)), ("an attention softcap",
                                                                         attention_softcap(m, cfg))):
        if value:
            cov.refusals.append(Refusal(name, kind, f"{what} ({value}) on a latent attention (the MLA wrapper runs "
                                        "full causal attention)"))
    if getattr(m, "is_causal", True) is False:
        cov.refusals.append(Refusal(name, kind, "bidirectional attention (the wrappers' attention is causal)"))
    layout, why = mla.rope_layout(m, seeded_copy)
    if layout is None:
        cov.refusals.append(Refusal(name, kind, why))
        return
    cov.classes["attention:mla"] = ("qk_rope_head_dim", int(m.qk_rope_head_dim))
    cov.readings.setdefault(name, {})["mla_rope"] = layout


# (Qwen3 and most), (HunYuan), (Persimmon's and StableLM's qk_layernorm)
QK_NORM_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"), ("q_layernorm", "k_layernorm"))


def qk_norm_names(m) -> tuple[str, str] | None:
    """The attribute names of an attention's q and k norms, or None where it has neither."""
    return next((pair for pair in QK_NORM_NAMES if any(getattr(m, n, None) is not None for n in pair)), None)


_QK_INPUTS: dict = {}  # (attention class, q norm name) -> _read_qk_inputs' answer


def _qk_inputs(attn: nn.Module, q_norm: str) -> tuple[bool, int] | None:
    """_read_qk_inputs, read once per attention class in a process (a copy of a real-size attention costs its
    weights)."""
    key = (type(attn), q_norm)
    if key not in _QK_INPUTS:
        _QK_INPUTS[key] = _read_qk_inputs(attn, q_norm)
    return _QK_INPUTS[key]


def qk_norm_after_rotary(attn: nn.Module, q_norm: str) -> bool | None:
    """Whether the attention's own forward hands its q norm the rotated heads (HunYuan: norm after rotary) rather
    than heads the rotary has not touched (Qwen3: before); None where the forward does not run on the probe."""
    read = _qk_inputs(attn, q_norm)
    return None if read is None else read[0]


def qk_norm_width(attn: nn.Module, q_norm: str) -> int | None:
    """How many features the attention's own forward hands its q norm per row (head_dim: per head; the projection's
    width: over it): what a norm without a weight normalises over. None where the forward does not run."""
    read = _qk_inputs(attn, q_norm)
    return None if read is None else read[1]


def _read_qk_inputs(attn: nn.Module, q_norm: str) -> tuple[bool, int] | None:
    """(after the rotary, width): the q norm's input under an identity rotary (cos 1, sin 0) and under a random one,
    on a copy with seeded weights; it moves with the rotary only where the rotary ran first."""
    from transformers import AttentionInterface

    AttentionInterface.register(QKV_PROBE, _raise_split)
    probe = seeded_copy(attn)
    first = next((getattr(probe, n) for n in ("q_proj", "query_key_value", "qkv_proj") if hasattr(probe, n)), None)
    if first is None:
        return None
    p = first.weight  # the rows' dtype: a model may keep other parameters in float32 (sinks, routers)
    for d in rotary_widths(probe):
        g = torch.Generator().manual_seed(1)
        h = torch.randn(1, 2, first.in_features, generator=g).to(p.device, p.dtype)
        rotaries = [(torch.ones(1, 2, d), torch.zeros(1, 2, d)),
                    (torch.randn(1, 2, d, generator=g), torch.randn(1, 2, d, generator=g))]
        seen: list[torch.Tensor] = []
        hook = getattr(probe, q_norm).register_forward_pre_hook(
            lambda mod, args: seen.append(args[0].detach().clone()))
        try:
            for cos, sin in rotaries:
                with torch.no_grad(), _attention_function(probe, QKV_PROBE):
                    try:
                        probe(hidden_states=h, position_embeddings=(cos.to(p.device, p.dtype),
                                                                    sin.to(p.device, p.dtype)), attention_mask=None)
                    except _Split:
                        pass
        except Exception:  # noqa: BLE001 - a forward this probe cannot drive (at this rotary width)
            continue
        finally:
            hook.remove()
        if len(seen) == 2 and seen[0].shape == seen[1].shape:
            return not torch.equal(seen[0], seen[1]), int(seen[0].shape[-1])
    return None


def each_head_norms(m: nn.Module) -> nn.ModuleList | None:
    """The norms of a module that holds nothing but one norm per head, each over the head's features, and whose
    forward on heads [batch, heads, tokens, head size] (HF's layout there) gives each head its own norm's output
    (StableLM's StableLmLayerNormPerHead), read on a seeded copy; None for anything else."""
    lists = [c for c in m.children() if isinstance(c, nn.ModuleList)]
    if len(lists) != 1 or any(True for _ in m.parameters(recurse=False)) or len(list(m.children())) != 1:
        return None
    norms = lists[0]
    widths = {int(n.weight.shape[-1]) for n in norms if is_norm(n) and getattr(n, "weight", None) is not None}
    if not norms or len(widths) != 1 or not all(is_norm(n) for n in norms):
        return None
    probe = seeded_copy(m).float()
    x = torch.randn(2, len(norms), 3, widths.pop(), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            got = probe(x)
            want = torch.stack([n(x[:, h]) for h, n in enumerate(next(iter(probe.children())))], dim=1)
    except Exception:  # noqa: BLE001 - a forward this probe cannot drive
        return None
    return norms if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want) else None


def _qk_norm_features(m, norm_name: str, norm: nn.Module, per_head: nn.ModuleList | None) -> int:
    """How many features one q/k norm of the attention normalises: one head's norm's width (StableLM's list), the
    norm's weight width, or a weightless norm's width read from the forward; 0 where none of these tells."""
    if per_head is not None:
        return int(per_head[0].weight.shape[-1])
    if getattr(norm, "weight", None) is not None:
        return int(norm.weight.shape[-1])
    return (qk_norm_width(m, norm_name) or 0) if is_weightless_norm(norm) else 0


def _read_qk_norms(cov: LayerCoverage, name: str, m) -> None:
    """q/k norms (q_norm/k_norm, HunYuan's query_layernorm/key_layernorm, Persimmon's and StableLM's
    q_layernorm/k_layernorm): per head (one norm over head_dim features, or StableLM's one norm for each head) or
    over the whole projection (each over its projection's width, heads * head_dim), before the rotary; per head
    after it too, read from the forward (qk_norm_after_rotary). Anything else, or one of each kind, is refused."""
    names = qk_norm_names(m)
    if names is None:
        return
    cov.readings.setdefault(name, {})["qk_norms"] = names
    # a fused qkv projection (Persimmon's query_key_value) splits before the heads are normed: per head only
    projs = (m.q_proj, m.k_proj) if hasattr(m, "q_proj") else (None, None)
    norms = [(n, getattr(m, n, None), proj) for n, proj in zip(names, projs)]
    norms = [(n, norm, proj) for n, norm, proj in norms if norm is not None]
    kinds = set()
    for norm_name, norm, proj in norms:
        per_head = each_head_norms(norm)
        features = _qk_norm_features(m, norm_name, norm, per_head)
        if per_head is not None and features == m.head_dim:  # StableLM's, per head
            kinds.add("attention:qk_norm_each_head")
            cov.variants[f"{name}.{norm_name}"] = "norm:each_head"
            for h, one in enumerate(per_head):
                _read_norm(cov, f"{name}.{norm_name}.norms.{h}", one)
            continue
        if features == m.head_dim:
            kinds.add("attention:qk_norm")
        elif proj is not None and features == proj.out_features:
            kinds.add("attention:qk_norm_projection")
        else:
            whole = f" or the whole projection ({proj.out_features})" if proj is not None else \
                " (after a fused qkv projection, nothing wider)"
            cov.refusals.append(Refusal(f"{name}.{norm_name}", type(norm).__name__,
                                        f"a norm over {features} features; the wrappers normalise each head "
                                        f"({m.head_dim}){whole}", "head_dim", m.head_dim))
            continue
        _read_norm(cov, f"{name}.{norm_name}", norm)
    if len(kinds) > 1:
        cov.refusals.append(Refusal(name, type(m).__name__, "one of q_norm/k_norm per head, the other over the "
                                    "whole projection"))
    for kind in kinds:
        cov.classes[kind] = (None, None)
    if kinds == {"attention:qk_norm_projection"}:
        cov.variants[name] = "attention:qk_norm_projection"  # the wrapper norms before the heads split
    after = qk_norm_after_rotary(m, norms[0][0]) if norms and not is_no_rope(m) else False
    if after is None:
        cov.refusals.append(Refusal(name, type(m).__name__, "q/k norms whose place beside the rotary (before or "
                                    "after it) the probe could not read from the attention's forward"))
    elif after:
        if "attention:qk_norm_projection" in kinds:
            cov.refusals.append(Refusal(name, type(m).__name__, "q/k norms over the whole projection after the "
                                        "rotary"))
        cov.classes["attention:qk_norm_after_rotary"] = (None, None)
        cov.readings[name]["qk_norm_after_rotary"] = True


def _read_shared_expert(cov: LayerCoverage, name: str, m, cfg, child: str) -> None:
    """A shared expert (child: shared_expert, shared_experts or shared_mlp): a gated MLP on every token, times
    sigmoid(shared_expert_gate(x)) (a linear to one feature) where the block has that gate (Qwen2-MoE), added to
    the routed experts' output."""
    shared, gate = getattr(m, child), getattr(m, "shared_expert_gate", None)
    field = ("shared_expert_intermediate_size", getattr(cfg, "shared_expert_intermediate_size", None))
    variant = activation_variant(mlp_activation(shared)) if is_gated_mlp(shared) else None
    if variant is None:
        cov.refusals.append(Refusal(f"{name}.{child}", type(shared).__name__, "a shared expert that is not a "
                                    "gated MLP with SiLU or GELU-tanh", *field))
        return
    if gate is not None and not (isinstance(gate, nn.Linear) and gate.out_features == 1):
        cov.refusals.append(Refusal(f"{name}.shared_expert_gate", type(gate).__name__, "a shared-expert gate that "
                                    "is not a linear to one feature"))
        return
    cov.classes[variant] = _act_field(cfg)
    cov.variants[f"{name}.{child}"] = variant
    cov.classes["moe:shared_expert"] = field
    cov.readings.setdefault(name, {})["shared_expert"] = child


def _moe_unused_children(block: nn.Module, shared: str | None) -> list[str]:
    """A MoE block's children that its wrapper runs none of: other than its router (with whatever holds its
    selection bias), experts, shared expert (and that expert's sigmoid gate), dropout or identity. A bias the block
    hands its router is a tensor of its own, not a child."""
    router = moe_router(block)
    return [n for n, c in block.named_children() if n not in (shared, "shared_expert_gate") and c is not router
            and c is not block.experts and not isinstance(c, (nn.Dropout, nn.Identity))]


def _read_experts(cov: LayerCoverage, name: str, experts: nn.Module, cfg) -> None:
    """The routed experts: SiLU experts the MoE wrappers compute from their weights (moe:topk_silu), else experts
    of the model's own that act on each token alone, run as they are one token at a time (moe:own_experts)."""
    silu = activation_variant(getattr(experts, "act_fn", None)) == "mlp:silu_and_mul"
    if silu and experts_compute_swiglu(experts):
        cov.classes["moe:topk_silu"] = ("num_experts", getattr(cfg, "num_experts", None))
    elif experts_act_per_token(experts):
        cov.classes["moe:own_experts"] = ("experts", type(experts).__name__)
        cov.readings.setdefault(name, {})["own_experts"] = True
    elif not silu:
        cov.refusals.append(Refusal(f"{name}.experts", type(experts).__name__, "MoE experts with an activation "
                                    "other than SiLU whose own forward does not act on each token alone",
                                    *_act_field(cfg)))
    else:
        cov.refusals.append(Refusal(f"{name}.experts", type(experts).__name__, "routed experts whose own "
                                    "forward is not weight x down(silu(gate x) * up x) summed over the top-k "
                                    "slots on their [gate; up] and down weights (read from their forward; e.g. "
                                    "interleaved gate and up, a bias, a norm after each expert) and does not act "
                                    "on each token alone"))


def _read_mlp(cov: LayerCoverage, name: str, m, cfg) -> None:
    kind = type(m).__name__
    handed = _handed_bias_name(m) if is_moe_block(m) else None  # the wrapper hands it to the routing
    _read_unused_parts(cov, name, m, "an MLP", None, (handed,) if handed is not None else ())
    if is_moe_block(m):
        rule = router_routing(moe_router(m), cfg, handed_bias(m))
        # the bias the router's logits add, by name (GPT-OSS's router linear): the wrapper's logits GEMM takes it
        cov.readings.setdefault(name, {})["logit_bias"] = router_logit_bias_name(moe_router(m))
        scale = getattr(m, "routed_scaling_factor", getattr(cfg, "routed_scaling_factor", None))
        if scale not in (None, 1, 1.0) and (rule is None or rule.scale != float(scale)):
            # the scale is applied outside the router (to the block's output): not what the wrappers compute
            cov.refusals.append(Refusal(name, kind, "routed experts scaled by a routed_scaling_factor outside "
                                        "the router's top-k weights", "routed_scaling_factor", scale))
        child = shared_expert_name(m)
        if child is not None:
            _read_shared_expert(cov, name, m, cfg, child)
        extra = _moe_unused_children(m, child)
        if extra:
            cov.refusals.append(Refusal(name, kind, f"an MoE block with submodules its wrapper does not run "
                                        f"({', '.join(extra)}): e.g. a norm of the block's output"))
        _read_experts(cov, name, m.experts, cfg)
        if rule is None:
            cov.refusals.append(Refusal(name, kind, "a router whose top-k experts and weights are none of the "
                                        "rules the wrappers compute (softmax or sigmoid scores, renormalised or "
                                        "not, a selection bias, grouped top-k, a routed scale), read from its "
                                        "own forward"))
        else:  # the wrappers take it from here rather than read the router again
            cov.readings.setdefault(name, {})["routing"] = rule
            if not rule.plain:
                cov.classes["moe:score_router"] = ("router", rule.describe())
    elif is_gated_mlp(m):
        variant = activation_variant(mlp_activation(m))
        if variant is None:
            cov.refusals.append(Refusal(name, kind, "a gated MLP whose activation is neither SiLU nor GELU-tanh",
                                        *_act_field(cfg)))
        else:
            cov.classes[variant] = _act_field(cfg)
            cov.variants[name] = variant
    elif plain_mlp_parts(m) is not None:
        up, down, act = plain_mlp_parts(m)
        variant = plain_activation(getattr(m, act))
        if variant is None and acts_per_row(getattr(m, act)):
            cov.classes["mlp:own_activation"] = (act, type(getattr(m, act)).__name__)
            cov.variants[name] = f"mlp:plain:{up}:{down}:{act}:own"
        elif variant is None:
            cov.refusals.append(Refusal(name, kind, f"an ungated MLP whose activation ({type(getattr(m, act)).__name__}"
                                        f") is none of torch's {', '.join(PLAIN_ACTS)}", *_act_field(cfg)))
        else:
            field = _act_field(cfg)
            cov.classes["mlp:plain"] = field
            if str(field[1]).lower() not in TORCH_ACTIVATION_NAMES:
                cov.classes["mlp:plain_vllm_kernel"] = field
            cov.variants[name] = f"mlp:plain:{up}:{down}:{act}:{variant}"
    else:
        cov.refusals.append(Refusal(name, kind, "an MLP that is neither a gated MLP (gate/up or fused gate_up, "
                                    "down), an ungated one (up, activation, down) nor a top-k MoE"))


class _Answer(nn.Module):
    """A stand-in sublayer returning a constant the size of its input (the parallel-sum probe)."""

    def __init__(self, value: float, pair: bool):
        super().__init__()
        self.value, self.pair = value, pair

    def forward(self, hidden_states=None, *args, **kwargs):
        out = torch.full_like(hidden_states, self.value)
        return (out, None) if self.pair else out


def _forward_with_stand_ins(layer: nn.Module, stand_ins: dict[str, nn.Module], x: torch.Tensor, whole: bool = False):
    """The layer's own forward on x with some children replaced (a shallow copy: the layer keeps its own), its
    hidden output (whole: what the forward returns, a tuple where it returns one); None where the forward does
    not run that way."""
    probe = copy.copy(layer)
    probe._modules = {**probe._modules, **stand_ins}
    try:
        with torch.no_grad():
            out = type(layer).forward(probe, x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - a layer that does not run on the probe is not read
        return None
    return out if whole or not isinstance(out, tuple) else out[0]


def layer_output_count(layer: nn.Module) -> int:
    """How many values a decoder layer's own forward returns: 0 for one tensor (most transformers 5 layers), else
    the length of its tuple (Falcon's: the output and the attention weights), which its model indexes. Read from
    that forward with stand-ins (its norms passing x through, its attention and MLP giving tensors of their own),
    also on the meta device; 0 where it does not run so."""
    attn, mlp = attention_name(layer), mlp_name(layer)
    x = torch.zeros(1, 2, 8)
    stand = {n: nn.Identity() for n, c in layer.named_children() if n not in (attn, mlp)}
    stand[attn] = _Tagged(torch.zeros(1, 2, 8), pair=not mamba_modules.is_scan_mixer(getattr(layer, attn)))
    stand[mlp] = _Tagged(torch.zeros(1, 2, 8), pair=False)
    out = _forward_with_stand_ins(layer, stand, x, whole=True)
    return len(out) if isinstance(out, tuple) else 0


def _parallel_sum(layer: nn.Module, r: float, a: float, m: float) -> float | None:
    out = _forward_with_stand_ins(layer, {"input_layernorm": nn.Identity(), attention_name(layer): _Answer(a, True),
                                          mlp_name(layer): _Answer(m, False)}, torch.full((1, 1, 4), r))
    return None if out is None else float(out.flatten()[0])


def parallel_sum_order(layer: nn.Module) -> str | None:
    """How a one-norm parallel layer adds its residual r, attention a and MLP m in float32, from its own forward
    with stand-ins (the norm passing x through): "sublayers_first" for (a + m) + r (Phi), "residual_first" for
    (r + a) + m (Cohere), "other" for another order; None when the probe does not run. Two probes where these
    orders round differently: (r, a, m) = (1, 2**25, -2**25) gives 1, 0, 0 for the three orders above and
    (r + m) + a; (2**25, 1, -2**25) gives 0, 0, 1 for (r + m) + a."""
    big = 2.0 ** 25
    first, second = _parallel_sum(layer, 1.0, big, -big), _parallel_sum(layer, big, 1.0, -big)
    if first is None or second is None:
        return None
    if (first, second) == (1.0, 0.0):
        return "sublayers_first"
    return "residual_first" if (first, second) == (0.0, 0.0) else "other"


# -- a decoder layer's norms by what they do, whatever their names -------------------------------------------------
def _residual_then(x, a, b):  # (x + a) + b: the sublayers added to the residual one after the other
    return (x + a) + b


def _sublayers_then(x, a, b):  # (a + b) + x: the two sublayers summed, then the residual (GPT-NeoX, Falcon)
    return (a + b) + x


# Each structure's dataflow, by role: what each norm and sublayer is handed ("x": the layer's input; a role: that
# child's output; ("x+", role): the residual add of the input and that output), the output's two terms and how
# they join the residual. The role names are the ones the wrappers' layer forwards read (modules.LAYER_FORWARDS).
NORM_DATAFLOW = {
    "decoder:two_norm": ({"input_layernorm": "x", "attention": "input_layernorm",
                          "post_attention_layernorm": ("x+", "attention"), "mlp": "post_attention_layernorm"},
                         ("attention", "mlp"), _residual_then),
    "decoder:four_norm": ({"input_layernorm": "x", "attention": "input_layernorm",
                           "post_attention_layernorm": "attention",
                           "pre_feedforward_layernorm": ("x+", "post_attention_layernorm"),
                           "mlp": "pre_feedforward_layernorm", "post_feedforward_layernorm": "mlp"},
                          ("post_attention_layernorm", "post_feedforward_layernorm"), _residual_then),
    "decoder:post_norm": ({"attention": "x", "post_attention_layernorm": "attention",
                           "mlp": ("x+", "post_attention_layernorm"), "post_feedforward_layernorm": "mlp"},
                          ("post_attention_layernorm", "post_feedforward_layernorm"), _residual_then),
    # attention and MLP side by side, each on a norm of its own of the layer's input (Falcon's ln_attn, ln_mlp)
    "decoder:parallel_two_norm": ({"input_layernorm": "x", "attention": "input_layernorm",
                                   "post_attention_layernorm": "x", "mlp": "post_attention_layernorm"},
                                  ("attention", "mlp"), _sublayers_then),
}


class _Tagged(nn.Module):
    """A stand-in child for the dataflow probe: keeps what it is handed, returns a tensor of its own."""

    def __init__(self, out: torch.Tensor, pair: bool):
        super().__init__()
        self.out, self.pair, self.seen = out, pair, None

    def forward(self, hidden_states=None, *args, **kwargs):
        self.seen = hidden_states if hidden_states is not None else args[0]
        out = self.out.clone()  # a copy: the layer may add into it in place (Falcon: mlp_output += attention)
        return (out, None) if self.pair else out


def norm_roles(layer: nn.Module) -> tuple[str, dict[str, str]] | None:
    """(structure, {role: child name}) of a decoder layer whose norms the wrappers know by role: read from the
    layer's own forward with stand-ins (each norm, the attention and the MLP return a tensor of their own, and the
    probe sees what each is handed and what the layer returns), matched against NORM_DATAFLOW. So a Llama-like layer
    whose norms are named otherwise (VaultGemma's pre_feedforward_layernorm, GLM-4's post_self_attn_layernorm,
    Apertus' attention_layernorm) is read as what it computes. None where no structure matches or the forward does
    not run on the probe."""
    attn_name, mlp = attention_name(layer), mlp_name(layer)
    norms = [n for n, c in layer.named_children() if n not in (attn_name, mlp) and not isinstance(c, nn.Dropout)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 8, generator=g)
    stand = {n: _Tagged(torch.randn(1, 2, 8, generator=g), pair=False) for n in norms}
    # an attention returns (output, weights), a Mamba mixer its output alone
    stand["attention"] = _Tagged(torch.randn(1, 2, 8, generator=g),
                                 pair=not mamba_modules.is_scan_mixer(getattr(layer, attn_name)))
    stand["mlp"] = _Tagged(torch.randn(1, 2, 8, generator=g), pair=False)
    out = _forward_with_stand_ins(layer, {attn_name if n == "attention" else mlp if n == "mlp" else n: t
                                          for n, t in stand.items()}, x)
    if out is None:
        return None

    def source(v):
        """What a child was handed: "x", a child's output (its name), or ("x+", name): x plus that output."""
        if v is None:
            return None
        for n, t in stand.items():
            if torch.equal(v, t.out):
                return n
            if torch.equal(v, x + t.out):
                return ("x+", n)
        return "x" if torch.equal(v, x) else None

    flow = {n: source(t.seen) for n, t in stand.items()}
    for structure, (template, terms, total) in NORM_DATAFLOW.items():
        if len(template) - 2 != len(norms):  # the template's roles but attention and mlp
            continue
        names = {"attention": "attention", "mlp": "mlp"}  # role -> child; norms resolved in template order
        for sub in ("attention", "mlp"):  # a norm that feeds a sublayer is the one that sublayer was handed
            role = template[sub]
            if isinstance(role, str) and role in template and flow[sub] in norms:
                names[role] = flow[sub]

        def expected(src):
            return src if src == "x" else ("x+", names[src[1]]) if isinstance(src, tuple) else names[src]

        for role, src in template.items():
            if role not in names:
                found = [n for n in norms if n not in names.values() and flow[n] == expected(src)]
                if len(found) != 1:
                    break
                names[role] = found[0]
        else:
            a, b = (stand[names[t]].out for t in terms)
            if all(flow[names[r]] == expected(src) for r, src in template.items()) \
                    and torch.equal(out, total(x, a, b)):
                return structure, {r: n for r, n in names.items() if r not in ("attention", "mlp")}
    return None


# an attention's submodules that the wrappers' attention forward runs (others: refused)
ATTENTION_PARTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "dense", "qkv_proj", "query_key_value",
                             "q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm",
                             "key_layernorm"})


def _read_unused_parts(cov: LayerCoverage, name: str, m: nn.Module, what: str, parts: frozenset | None,
                       own_used: tuple = ()) -> None:
    """Parameters a module holds itself (other than `own_used`, which its wrapper reads), and submodules outside
    `parts` (None: any), are weights or computation the wrappers' forward for it never runs: the wrapped model
    would compute another one (learned residual scales, a differential attention's lambdas, a dynamic mask's
    parameters)."""
    own = [n for n, _ in m.named_parameters(recurse=False) if n not in own_used]
    if own:
        cov.refusals.append(Refusal(name, type(m).__name__, f"{what} with parameters of its own the wrappers do not "
                                    f"use ({', '.join(own)})"))
    extra = [n for n, c in m.named_children() if parts is not None and n not in parts
             and not isinstance(c, (nn.Dropout, nn.Identity))]
    if extra:
        cov.refusals.append(Refusal(name, type(m).__name__, f"{what} with submodules the wrappers do not run "
                                    f"({', '.join(extra)})"))


def read_layer(name: str, layer: nn.Module, cfg) -> LayerCoverage:
    """One decoder layer: its structure (which norms), attention, MLP and norms."""
    cov = LayerCoverage(name, type(layer).__name__)
    _read_unused_parts(cov, name, layer, "a decoder layer", None)
    children = dict(layer.named_children())
    for n, c in children.items():
        if isinstance(c, nn.Dropout) and float(c.p) != 0.0:
            cov.refusals.append(Refusal(f"{name}.{n}", type(c).__name__, f"dropout of probability {c.p} (the "
                                        "wrappers' forward runs without dropout)"))
    attn_name, mlp = attention_name(layer), mlp_name(layer)
    norms = tuple(n for n, c in children.items() if n not in (attn_name, mlp) and not isinstance(c, nn.Dropout))
    structure = next((kind for names, kind in DECODER_NORMS.items() if set(names) == set(norms)), None)
    read = norm_roles(layer) if structure is None else None  # norms named otherwise: read what they do
    if read is not None:
        structure = read[0]
        cov.readings[name] = {"norm_roles": read[1]}
    count = layer_output_count(layer)
    if count:  # the wrapped layer returns as many values, its output first
        cov.readings.setdefault(name, {})["output_count"] = count
    if structure is None:
        cov.refusals.append(Refusal(name, cov.module_class, f"a decoder layer of children {', '.join(children)}; "
                                    "the wrappers implement two-norm (Llama), four-norm (Gemma) and post-norm "
                                    "(OLMo-2) layers"))
    else:
        scale_name = residual_scale_name(layer)  # Granite, MiniCPM3: residual + sublayer(x) * scale
        scale = getattr(layer, scale_name, None) if scale_name else None
        if scale is not None and float(scale) != 1.0:
            if structure == "decoder:two_norm":
                structure = "decoder:scaled_residual"
            else:
                cov.refusals.append(Refusal(name, cov.module_class, f"sublayer outputs scaled by {scale} before "
                                            f"the residual add of a {structure} layer (the wrappers scale them in "
                                            "two-norm layers only)", scale_name, scale))
        order = parallel_sum_order(layer) if structure == "decoder:parallel" else None
        if order == "residual_first":
            structure = "decoder:parallel_residual_first"  # Cohere: residual + attention + MLP
        elif order == "other":
            cov.refusals.append(Refusal(name, cov.module_class, "a parallel layer adding residual, attention and MLP "
                                        "in another order than (attention + MLP) + residual or residual + "
                                        "attention + MLP, the orders the wrappers implement"))
        if getattr(layer, "use_parallel_residual", False) and structure == "decoder:two_norm":
            structure = "decoder:parallel_two_norm"  # GPT-NeoX: attention and MLP each on a norm of the input
        cov.classes[structure] = (scale_name, scale) if structure == "decoder:scaled_residual" \
            else ("use_parallel_residual", True) if getattr(layer, "use_parallel_residual", False) else (None, None)
        cov.variants[name] = structure
    for n in norms:
        if any(isinstance(c, nn.Linear) for c in children[n].modules()):  # a sublayer (a second MLP), not a norm
            cov.refusals.append(Refusal(f"{name}.{n}", type(children[n]).__name__, "a sublayer beside the "
                                        "attention and the MLP that the wrappers' layer forward does not run"))
            continue
        _read_norm(cov, f"{name}.{n}", children[n])
    attn = getattr(layer, attn_name)
    if is_attention(attn):
        _read_attention(cov, f"{name}.{attn_name}", attn, cfg)
    elif mla.is_mla_attention(attn):
        _read_mla_attention(cov, f"{name}.{attn_name}", attn, cfg)
    elif mamba_modules.is_mixer1(attn):  # Jamba's mamba layers: a Mamba-1 mixer in the attention's place
        cov.classes["mixer:mamba1"] = ("layer_types", "mamba")
        cov.refusals += [Refusal(f"{name}.{attn_name}", type(attn).__name__, why)
                         for why in mamba_modules.mixer1_problems(attn)]
    elif mamba_modules.is_mixer(attn):  # Bamba's mamba layers: a Mamba-2 mixer in the attention's place
        cov.classes["mixer:mamba2"] = ("layer_types", "mamba")
        cov.refusals += [Refusal(f"{name}.{attn_name}", type(attn).__name__, why)
                         for why in mamba_modules.mixer_problems(attn)]
    else:
        cov.refusals.append(Refusal(f"{name}.{attn_name}", type(attn).__name__,
                                    "attention without q/k/v (or fused qkv) and o projections"))
    _read_mlp(cov, f"{name}.{mlp}", getattr(layer, mlp), cfg)
    cov.classes["linear"] = (None, None)
    return cov


def _read_embedding(cov: LayerCoverage, model: nn.Module) -> None:
    emb = model.get_input_embeddings()
    if not isinstance(emb, nn.Embedding):
        cov.refusals.append(Refusal("embed_tokens", type(emb).__name__, "an embedding that is not nn.Embedding"))
    elif type(emb).forward is not nn.Embedding.forward:
        if isinstance(getattr(emb, "embed_scale", None), torch.Tensor):
            cov.classes["embedding:scaled"] = ("hidden_size", getattr(model.config.get_text_config(), "hidden_size"))
        else:
            cov.refusals.append(Refusal("embed_tokens", type(emb).__name__, "an embedding with a forward of its own"))
    else:
        cov.classes["embedding"] = (None, None)
    head = model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        cov.classes["embedding:tied"] = ("tie_word_embeddings", True)


def read_model(model: nn.Module) -> LayerCoverage:
    """The modules outside the decoder layers: embedding, rotary table(s), final norm, logits."""
    cfg = model.config.get_text_config()
    cov = LayerCoverage("model", type(model).__name__)
    _read_embedding(cov, model)
    rotary = rotary_modules(model)
    if not rotary and not any(_takes_rope(m) for m in model.modules() if is_attention(m)):
        pass  # tic: no rotary, and no attention that takes one (Mamba-2, NemotronH), issue 31
    elif len(rotary) != 1:
        cov.refusals.append(Refusal("rotary", ", ".join(type(m).__name__ for _, m in rotary) or "none",
                                    f"{len(rotary)} rotary modules ({', '.join(n for n, _ in rotary) or 'none'}); "
                                    "the wrappers read one rotary module"))
    elif rotary_per_layer_type(rotary[0][1]):
        cov.classes["rope:per_layer_type"] = ("layer_types", sorted(set(getattr(cfg, "layer_types", []) or [])))
    else:
        cov.classes["rope:one_table"] = (None, None)
    style, why = rotary_style(model, rotary[0][1]) if len(rotary) == 1 else (None, None)
    if style is not None and style.startswith("interleaved"):
        cov.classes["rope:interleaved"] = (None, None)
    if style is not None and style.endswith("_reversed"):
        cov.classes["rope:reversed"] = (None, None)
    if why is not None:
        cov.refusals.append(Refusal("rotary", type(rotary[0][1]).__name__, why))
    final = final_norm(model)
    if final is None:
        cov.refusals.append(Refusal("model.norm", "none", "no final norm (model.model.norm)"))
    else:
        _read_norm(cov, next(n for n, m in model.named_modules() if m is final), final)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None:
        cov.classes["logits:softcap"] = ("final_logit_softcapping", cap)
    scaling = getattr(cfg, "logits_scaling", None)
    if scaling is not None and float(scaling) != 1.0:
        if cap is not None:
            cov.refusals.append(Refusal("lm_head", type(model).__name__, "final logits both softcapped and scaled",
                                        "logits_scaling", scaling))
        if logits_scaling_settable(cfg):
            cov.classes["logits:scaled"] = ("logits_scaling", scaling)
        else:
            cov.classes["logits:hidden_scaled_by_model"] = ("logits_scaling", scaling)
    return cov


RESIDUAL_SCALE_NAMES = ("residual_multiplier", "residual_scale")  # Granite's, MiniCPM3's


def residual_scale_name(layer) -> str | None:
    """The decoder layer's attribute that scales each sublayer's output before its residual add, or None."""
    return next((n for n in RESIDUAL_SCALE_NAMES if isinstance(getattr(layer, n, None), (int, float))), None)


def logits_scaling_settable(cfg) -> bool:
    """Whether the config's logits_scaling is a value (Granite's: applied to the logits by the model's forward, so
    the wrappers move it into lm_head and set it to 1) rather than a read-only property (MiniCPM3's, which its
    forward divides the last hidden states by before lm_head)."""
    prop = getattr(type(cfg), "logits_scaling", None)
    return not (isinstance(prop, property) and prop.fset is None)


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last layer: the base model's `norm` (whatever it computes: C0 reads it), else its last
    child that is a norm, whatever its name (norm_f, final_layernorm, final_layer_norm)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:  # a causal LM that names no base model of its own (Llama-4's text model)
        base = getattr(model, "model", model)
    norms = [c for _, c in base.named_children() if is_norm(c)]
    return getattr(base, "norm", None) or (norms[-1] if norms else None)


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_decoder_layer(m)]


# -- tic: Mamba-2 / NemotronH blocks (norm, mixer, residual), issue 31 ------------------------------------------
def _takes_rope(attention) -> bool:
    """Whether this attention applies rotary embeddings from a rotary module (NemotronH's has none)."""
    return "position_embeddings" in inspect.signature(type(attention).forward).parameters


def is_hybrid_block(m) -> bool:
    return set(dict(m.named_children())) == {"norm", "mixer"} and not is_decoder_layer(m)


def _read_block_mixer(cov: LayerCoverage, name: str, m, cfg) -> None:
    kind = type(m).__name__
    if mamba_modules.is_mixer(m):
        cov.classes["mixer:mamba2"] = ("layer_types", "mamba")
        cov.refusals += [Refusal(name, kind, why) for why in mamba_modules.mixer_problems(m)]
    elif mamba_modules.is_mixer1(m):
        cov.classes["mixer:mamba1"] = ("layer_types", "mamba")
        cov.refusals += [Refusal(name, kind, why) for why in mamba_modules.mixer1_problems(m)]
    elif is_attention(m):
        _read_attention(cov, name, m, cfg)
    elif all(isinstance(getattr(m, a, None), nn.Linear) for a in ("up_proj", "down_proj")) \
            and not hasattr(m, "gate_proj"):
        x = probe_input(16).reshape(-1)
        act = getattr(m, "act_fn", None)
        with torch.no_grad():
            relu2 = act is not None and torch.equal(act(x), torch.relu(x).square())
        if relu2:
            cov.classes["mlp:relu2"] = ("mlp_hidden_act", getattr(cfg, "mlp_hidden_act", None))
        else:
            cov.refusals.append(Refusal(name, kind, "an ungated MLP whose activation is not relu^2"))
    else:
        cov.refusals.append(Refusal(name, kind, "a block mixer that is neither Mamba-2, attention nor an MLP "
                                    "(e.g. NemotronH's sigmoid-routed MoE)"))


def read_hybrid_block(name: str, block: nn.Module, cfg) -> LayerCoverage:
    cov = LayerCoverage(name, type(block).__name__)
    cov.classes["decoder:hybrid_block"] = (None, None)
    _read_norm(cov, f"{name}.norm", block.norm)
    _read_block_mixer(cov, f"{name}.mixer", block.mixer, cfg)
    cov.classes["linear"] = (None, None)
    return cov


def read_coverage(model: nn.Module) -> list[LayerCoverage]:
    """Per decoder layer, then the model's own modules: the operator classes used and what is refused."""
    cfg = model.config.get_text_config()
    layers = [read_layer(n, m, cfg) if is_decoder_layer(m) else read_hybrid_block(n, m, cfg)
              for n, m in model.named_modules() if is_decoder_layer(m) or is_hybrid_block(m)]
    layers += _unknown_layers(model)
    _refuse_scan_only_decoder_stack(model, layers)
    if not layers:
        layers = [LayerCoverage("model.layers", "none", refusals=[Refusal(
            "model.layers", type(model).__name__, "no decoder layer with self_attn, mlp and a norm")])]
    return layers + [read_model(model)]


def _refuse_scan_only_decoder_stack(model: nn.Module, layers: list[LayerCoverage]) -> None:
    """Decoder layers whose token mixers are all Mamba mixers in the attention's place (a Jamba- or Bamba-style
    model cut or configured without its attention layers): transformers builds their causal mask from a cache of
    recurrent layers alone and stops (`get_mask_sizes`), so no engine can decode it. Refused on the first layer,
    one line."""
    decoders = [(n, m) for n, m in model.named_modules() if is_decoder_layer(m)]
    if decoders and all(mamba_modules.is_scan_mixer(getattr(m, attention_name(m))) for _, m in decoders):
        name, first = decoders[0]
        kind = "Mamba-1" if mamba_modules.is_mixer1(getattr(first, attention_name(first))) else "Mamba-2"
        cov = next(c for c in layers if c.layer == name)
        cov.refusals.append(Refusal(name, type(first).__name__, f"decoder layers with a {kind} mixer and no "
                                    "attention layer anywhere: transformers builds their causal mask from the cache "
                                    "and cannot from recurrent layers alone; keep an attention layer (a cut of the "
                                    "full model keeps one)"))


def layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's lists of decoder layers: each ModuleList named as transformers names one (inventory.LAYER_LISTS:
    ...layers, GPT-2's and Falcon's transformer.h), and any other whose length is the config's num_hidden_layers
    (a blocks list), outermost first."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    inside = [name + "." for name, m in model.named_modules() if is_decoder_layer(m) or is_hybrid_block(m)]
    return [(name, lst) for name, lst in model.named_modules() if isinstance(lst, nn.ModuleList) and len(lst)
            and (name.split(".")[-1] in LAYER_LISTS or len(lst) == n)
            and not any(name.startswith(prefix) for prefix in inside)]  # a list inside a layer is no layer list


def _unknown_layers(model: nn.Module) -> list[LayerCoverage]:
    """The entries of the model's layer lists (layer_lists) that are no layer kind the registry knows: each is
    refused, so one unknown layer among known ones is never left out of the wrapping unseen."""
    out = []
    for name, lst in layer_lists(model):
        for i, m in enumerate(lst):
            if not (is_decoder_layer(m) or is_hybrid_block(m)):
                n, kind = f"{name}.{i}", type(m).__name__
                out.append(LayerCoverage(n, kind, refusals=[Refusal(
                    n, kind, "a layer structure the wrappers do not know (children: "
                             f"{', '.join(dict(m.named_children())) or 'none'})")]))
    return out


def problem_lines(coverage: list[LayerCoverage], kernels: str) -> list[str]:
    """What `kernels` does not implement of a model read by read_coverage, one line per module and missing
    operator (the same line for several layers once, their indices grouped)."""
    return per_layer_once([p for cov in coverage for p in cov.problems(kernels)])


def coverage_problems(model: nn.Module, kernels: str = "consistent") -> list[str]:
    """problem_lines of this HF causal LM: empty when `apply` covers every operator."""
    return problem_lines(read_coverage(model), kernels)


def coverage_table(model: nn.Module) -> list[dict]:
    """The per-layer table C0 prints and `--json` carries."""
    return [cov.as_dict() for cov in read_coverage(model)]


def format_table(rows: list[dict]) -> list[str]:
    """The table as text lines: layer, class, operator classes, covered by which kernels (or refused)."""
    out = []
    for r in rows:
        by = ", ".join(r["covered_by"]) if r["covered_by"] else "NOT COVERED"
        out.append(f"{r['layer']} ({r['class']}): {' '.join(r['operator_classes'])} -> {by}")
        out += [f"  refused: {line}" for line in r["refused"]]
    return out


def per_layer_once(problems: list[str]) -> list[str]:
    """One entry per problem, not per layer: 'model.layers.0.x ...' and 'model.layers.3.x ...' read as
    'model.layers.{0,3}.x ...' (transformer.h.N and blocks.N alike)."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        m = re.search(r"\.(layers|h|blocks?)\.(\d+)\b", p)  # a layer list's entry: model.layers.3, transformer.h.3
        key = p if m is None else p[:m.start()] + f".{m.group(1)}.{{}}" + p[m.end():]
        groups.setdefault(key, []).append(m.group(2) if m else "")
    return [k if k.count("{}") == 0 else k.replace("{}", "{" + ",".join(v) + "}" if len(v) > 1 else v[0], 1)
            for k, v in groups.items()]

