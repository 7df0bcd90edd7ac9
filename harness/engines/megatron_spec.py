"""Megatron-core layer specs whose submodules are tic classes: every operator of a GPTModel layer runs through the
kernel wrappers (tic.harness.kernels.autograd.Ops), Megatron's own GPTModel / TransformerBlock / TransformerLayer
unchanged around them.

The classes follow the call sequence of tic's HF wrapping (tic.harness.kernels.modules) op for op, so a provider
sees the same calls, in the same shapes, whichever trainer runs it:
- the residual stream as a pair: the bias-dropout-add (`self_attn_bda`, `mlp_bda`) returns residual + delta and
  leaves (delta, residual) in the model's ResidualStream; the next norm (pre-MLP, the next layer's input norm, the
  final norm) runs add+RMSNorm on that pair (vLLM's fused_add_rms_norm) instead of RMSNorm of the rounded sum;
- q/k/v and gate/up as HF-order weights cut from Megatron's fused `linear_qkv` (per query group) and
  `linear_fc1` ([gate; up]) parameters, one GEMM when the provider fuses projections;
- neox rotary from the provider's cos|sin table by position, attention over each sequence's own keys, top-k routing
  and the experts' slot-order merge in `moe_experts`.
Megatron holds activations sequence-first [T, B, H]; each tic module works on [B, T, H] rows as the HF path does.
Positions and the attention mask of the running forward reach the attention modules through the model's
`ForwardBatch` (set by tic.harness.engines.megatron around each forward), not through Megatron's rotary arguments.

Nothing here imports Megatron at module level; `gpt_block_spec` does, when a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tic.harness.kernels.autograd import Ops
from tic.harness.kernels.modules import ResidualStream, RopeTable, RouteLog
from tic.harness.model.megatron_convert import AttentionShape, split_qkv


@dataclass
class ForwardBatch:
    """What every attention module of one forward reads: position ids [B, T] and the bool mask [B, 1, T, T]
    (True = attend), set by the engine for the length of one forward."""

    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class TicShared:
    """One model's shared pieces, handed to every tic submodule through the spec's params."""

    ops: Ops
    stream: ResidualStream
    rope: RopeTable
    batch: ForwardBatch
    routes: RouteLog
    fuse: bool  # the provider fuses q/k/v and gate/up into one GEMM each


def _param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class TicWeight(nn.Module):
    """A parameter holder under Megatron's submodule name (linear_qkv, linear_proj, linear_fc1, router, ...)."""

    def __init__(self, out_features: int, in_features: int, dtype, bias: bool = False):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None


class TicRMSNorm(nn.Module):
    """RMSNorm; a hidden-state norm (stream given) takes the (delta, residual) pair its input was added from."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, shared: TicShared | None = None,
                 stream: bool = True, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps, self.shared, self.use_stream = eps, shared, stream

    def forward(self, x):
        ops = self.shared.ops
        pair = self.shared.stream.take(x) if self.use_stream else None
        if pair is not None:
            return ops.add_rms_norm(pair[0], pair[1], self.weight, self.eps)[0]
        return ops.rms_norm(x, self.weight, self.eps)


class TicResidualAdd(nn.Module):
    """Megatron's bias-dropout-add slot (called as bda(training, fused)(out_with_bias, residual, p)): residual +
    delta, with the pair left for the next norm. No dropout: the compared forward has none."""

    def __init__(self, shared: TicShared | None = None, **_):
        super().__init__()
        self.shared = shared

    def forward(self, training: bool, fused: bool):
        return self._add

    def _add(self, out_with_bias, residual, prob):
        delta, bias = out_with_bias
        assert bias is None, "tic's layers have no output bias"
        out = residual + delta
        self.shared.stream.put(out, delta, residual)
        return out


def _batch_first(t: torch.Tensor) -> torch.Tensor:
    """[T, B, H] <-> [B, T, H], contiguous: the layout the HF path hands each kernel (some pick their path by
    stride and alignment)."""
    return t.transpose(0, 1).contiguous()


def _linear(shared: TicShared, x, weights: list, biases: list):
    """One GEMM over the concatenated weights when the provider fuses projections, else one per weight (the
    HF wrapping's two paths)."""
    if shared.fuse or len(weights) == 1:
        return shared.ops.linear(x, weights, biases)
    return torch.cat([shared.ops.linear(x, [w], [b]) for w, b in zip(weights, biases)], dim=-1)


class TicSelfAttention(nn.Module):
    def __init__(self, config, layer_number: int = 1, shared: TicShared | None = None, qkv_bias: bool = False, **_):
        super().__init__()
        self.shape = AttentionShape(config.num_attention_heads, config.num_query_groups, config.kv_channels)
        s, dtype, hidden = self.shape, config.params_dtype, config.hidden_size
        self.linear_qkv = TicWeight((s.heads + 2 * s.groups) * s.head_dim, hidden, dtype, bias=qkv_bias)
        self.linear_proj = TicWeight(hidden, s.heads * s.head_dim, dtype)
        if config.qk_layernorm:
            self.q_layernorm = TicRMSNorm(config, s.head_dim, config.layernorm_epsilon, shared, stream=False)
            self.k_layernorm = TicRMSNorm(config, s.head_dim, config.layernorm_epsilon, shared, stream=False)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.shared, self.scale = shared, s.head_dim ** -0.5

    def forward(self, hidden_states, attention_mask=None, **_):
        sh, ops, s = self.shared, self.shared.ops, self.shape
        x = _batch_first(hidden_states)
        B, T, D = x.shape[0], x.shape[1], s.head_dim
        weights = list(split_qkv(self.linear_qkv.weight, s))
        biases = list(split_qkv(self.linear_qkv.bias, s)) if self.linear_qkv.bias is not None else [None] * 3
        q, k, v = _linear(sh, x, weights, biases).split([w.shape[0] for w in weights], dim=-1)
        q, k, v = q.reshape(B, T, -1, D), k.reshape(B, T, -1, D), v.reshape(B, T, -1, D)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        pos = sh.batch.positions
        table = sh.rope.for_positions(pos, q.device)
        q, k = ops.rotary(q.reshape(B * T, -1, D), k.reshape(B * T, -1, D), pos.reshape(-1), table)
        q, k, v = q.reshape(B, T, -1, D).transpose(1, 2), k.reshape(B, T, -1, D).transpose(1, 2), v.transpose(1, 2)
        out = ops.attention(q, k, v, sh.batch.mask, self.scale)
        out = ops.linear(out.reshape(B, T, -1), [self.linear_proj.weight], [None])
        return _batch_first(out), None


class TicMLP(nn.Module):
    """SwiGLU: linear_fc1 = [gate; up], SiLU*mul rounded once, linear_fc2."""

    def __init__(self, config, shared: TicShared | None = None, ffn_hidden_size: int | None = None, **_):
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_hidden_size
        self.linear_fc1 = TicWeight(2 * ffn, config.hidden_size, config.params_dtype)
        self.linear_fc2 = TicWeight(config.hidden_size, ffn, config.params_dtype)
        self.shared = shared

    def forward(self, hidden_states, padding_mask=None, **_):
        sh = self.shared
        x = _batch_first(hidden_states)
        gate, up = self.linear_fc1.weight.chunk(2)
        h = sh.ops.silu_and_mul(_linear(sh, x, [gate, up], [None, None]))
        return _batch_first(sh.ops.linear(h, [self.linear_fc2.weight], [None])), None


class TicExpert(nn.Module):
    def __init__(self, config, ffn: int):
        super().__init__()
        self.linear_fc1 = TicWeight(2 * ffn, config.hidden_size, config.params_dtype)
        self.linear_fc2 = TicWeight(config.hidden_size, ffn, config.params_dtype)


class TicSequentialExperts(nn.Module):
    """Megatron's SequentialMLP parameter layout (local_experts.E.linear_fc{1,2}); the wrappers take them stacked."""

    def __init__(self, config):
        super().__init__()
        self.local_experts = nn.ModuleList(TicExpert(config, config.moe_ffn_hidden_size)
                                           for _ in range(config.num_moe_experts))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([e.linear_fc1.weight for e in self.local_experts]),
                torch.stack([e.linear_fc2.weight for e in self.local_experts]))


class TicMoE(nn.Module):
    """Router (top-k of the softmax, optionally renormalised) and experts merged in float32 in top-k slot order by
    the wrappers' moe_experts, on the HF path's [B*T, H] rows."""

    def __init__(self, config, shared: TicShared | None = None, renormalize: bool = True, **_):
        super().__init__()
        self.router = TicWeight(config.num_moe_experts, config.hidden_size, config.params_dtype)
        self.experts = TicSequentialExperts(config)
        self.shared, self.top_k, self.renormalize = shared, config.moe_router_topk, renormalize
        self.name = "mlp"  # the layer's full name is set by tic.harness.engines.megatron (route capture)

    def forward(self, hidden_states, padding_mask=None, **_):
        ops = self.shared.ops
        x = _batch_first(hidden_states)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        weights, ids = ops.moe_route(ops.linear(rows, [self.router.weight]), self.top_k, self.renormalize)
        calls = self.shared.routes.calls
        if calls is not None:
            calls.setdefault(self.name, []).append(ids.detach().to("cpu"))
        gate_up, down = self.experts.stacked()
        return _batch_first(ops.moe_experts(rows, weights, ids, gate_up, down).reshape(shape)), None


def gpt_block_spec(shared: TicShared, moe_layers: list[bool], qkv_bias: bool, renormalize: bool):
    """TransformerBlockSubmodules: one TransformerLayer spec per layer (dense or MoE MLP), tic submodules, tic's
    final norm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = ModuleSpec(module=TicRMSNorm, params={"shared": shared})
    add = ModuleSpec(module=TicResidualAdd, params={"shared": shared})

    def layer(moe: bool):
        mlp = ModuleSpec(module=TicMoE, params={"shared": shared, "renormalize": renormalize}) if moe \
            else ModuleSpec(module=TicMLP, params={"shared": shared})
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(module=TicSelfAttention, params={"shared": shared, "qkv_bias": qkv_bias}),
            self_attn_bda=add, pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=add))

    return TransformerBlockSubmodules(layer_specs=[layer(m) for m in moe_layers], layer_norm=norm)
