"""Which rounding rules a provider's FP8 operators follow, read from their outputs (not from a setting).

A block-FP8 deployment has two rounding rules besides the format: the weight tiles' scales (the checkpoint's
amax / 448, or those rounded up to a power of two and the codes requantized: vLLM's DeepGEMM path with UE8M0
scales, `requant_weight_ue8m0_inplace`) and the activations' per-token-group scales (amax / 448, or its UE8M0
rounding). vLLM picks them by platform and kernel (`VLLM_USE_DEEP_GEMM_E8M0`, on by default where DeepGEMM runs),
and its linear and fused-MoE paths need not agree. C2's stock model and C7's reference compute the FP8 model in
value, so they must round as the deployment does: a model rounded otherwise differs by the format's step.

Attention over an FP8 KV cache has its own (KvRule): whether the query and the probabilities are rounded to e4m3
too (FlashAttention's FP8 forward) or only K and V (a backend that dequantizes the cache).

`detect_linear`, `detect_experts` and `detect_kv_attention` run an operator once on seeded operands (weight scales
not powers of two) and compare its output with each candidate rule's, computed in float32 and rounded to the
output dtype: the rule the operator follows agrees with nearly every element (within AGREE_REL: float32
accumulation order is all that separates them), the others with almost none. No clear winner: None, and the
records say the rule was not identified.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tic.harness.kernels.fp8_cpu import P_SCALE, e4m3_round, per_token_group_quant
from tic.harness.model.quantize import dequantize_weight_blocks, quantize_weight_blocks

# an element agrees with a candidate within this relative distance: float32 accumulation order moves a float32
# output by ~1e-6 and rarely a 16-bit one by its rounding step; another scale rule moves most elements by percents
AGREE_REL = 1e-4
MATCH_MIN = 0.5  # the winning rule's share of agreeing output elements, at least
RUNNER_UP_MAX = 0.5  # the runner-up's share, at most this fraction of the winner's


@dataclass(frozen=True)
class Fp8Rule:
    """weights_ue8m0: weight tiles requantized to power-of-two scales; activations_ue8m0: activation group scales
    rounded up to a power of two."""
    weights_ue8m0: bool = False
    activations_ue8m0: bool = False

    def describe(self) -> str:
        w = "UE8M0 (requantized)" if self.weights_ue8m0 else "the checkpoint's"
        a = "UE8M0" if self.activations_ue8m0 else "amax / 448"
        return f"weight scales {w}, activation scales {a}"

    def tiles(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> tuple:
        """The (codes, scales) an operator following this rule multiplies by, from the checkpoint's."""
        if not self.weights_ue8m0:
            return codes, scales
        return quantize_weight_blocks(dequantize_weight_blocks(codes, scales, block, torch.float32), block,
                                      ue8m0=True)

    def weights(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        """The float32 weights an operator following this rule multiplies by."""
        return dequantize_weight_blocks(*self.tiles(codes, scales, block), block, torch.float32)

    def activations(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """x quantized per token group and dequantized, in float32."""
        q, s = per_token_group_quant(x.detach(), group, ue8m0=self.activations_ue8m0)
        return (q.float() * s.repeat_interleave(group, dim=-1)).reshape(x.shape)


CANDIDATES = tuple(Fp8Rule(w, a) for w, a in itertools.product((False, True), repeat=2))
DEFAULT = CANDIDATES[0]  # the checkpoint's scales, amax / 448 activations: tic's CPU kernels


def _seeded(shape: tuple, block: tuple[int, int], seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 (codes, scales) of a seeded weight: its tile scales are not powers of two (UE8M0 moves them)."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scales = quantize_weight_blocks(w, block)
    return codes.to(device), scales.to(device)


def _rows(k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Eight seeded activation rows of k columns, of varied scales."""
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.3, 3.0, 8)[:, None]
    return x.to(device=device, dtype=dtype)


def _pick(got: torch.Tensor, candidates: dict[Fp8Rule, torch.Tensor]) -> Fp8Rule | None:
    share = {r: float(((c.float() - got).abs() <= AGREE_REL * got.abs()).float().mean()) for r, c in candidates.items()}
    ranked = sorted(share, key=share.get, reverse=True)
    best, second = share[ranked[0]], share[ranked[1]]
    return ranked[0] if best >= MATCH_MIN and second <= RUNNER_UP_MAX * best else None


def detect_linear(linear: Callable, block: tuple[int, int], dtype: torch.dtype, device) -> Fp8Rule | None:
    """linear(x, codes, scales) -> x @ W.T as the operator under test runs it (no bias)."""
    codes, scales = _seeded((2 * block[0], 2 * block[1]), block, 0, device)
    x = _rows(2 * block[1], dtype, device)
    with torch.no_grad():
        got = linear(x, codes, scales).float().cpu()
    return _pick(got, {r: F.linear(r.activations(x, block[1]), r.weights(codes, scales, block)).to(dtype).cpu()
                       for r in CANDIDATES})


def detect_experts(experts: Callable, block: tuple[int, int], dtype: torch.dtype, device) -> Fp8Rule | None:
    """experts(x, weights, ids, gu_codes, gu_scales, down_codes, down_scales) -> the block's output, as the
    operator under test runs it: two experts, one per token, each a gated MLP whose SiLU*mul is quantized again."""
    bn, bk = block
    hidden, inter = 2 * bk, math.lcm(bn, bk)  # the down GEMM's K: whole weight tiles and activation groups
    gu, gu_s = _seeded((2, 2 * inter, hidden), block, 0, device)
    down, down_s = _seeded((2, hidden, inter), block, 1, device)
    x = _rows(hidden, dtype, device)
    ids = (torch.arange(x.shape[0], device=device) % 2)[:, None]
    weights = torch.ones(x.shape[0], 1, device=device)
    with torch.no_grad():
        got = experts(x, weights, ids, gu, gu_s, down, down_s).float().cpu()
    out = {}
    for r in CANDIDATES:
        rows = []
        for t in range(x.shape[0]):
            e = int(ids[t, 0])
            h = F.linear(r.activations(x[t:t + 1], bk), r.weights(gu[e], gu_s[e], block)).to(dtype)
            gate, up = h.float().chunk(2, dim=-1)
            between = (F.silu(gate) * up).to(dtype)
            rows.append(F.linear(r.activations(between, bk), r.weights(down[e], down_s[e], block)))
        out[r] = torch.cat(rows).to(dtype).cpu()
    return _pick(got, out)


# -- attention over an FP8 KV cache -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvRule:
    """How attention over an FP8 KV cache rounds, besides K and V themselves (always rounded to e4m3, scale 1):
    query_rounded: q too (FlashAttention's FP8 forward takes an FP8 query; a backend that dequantizes K/V to the
    model dtype does not); probs_rounded: P = exp(s - max) * 2**8 rounded to e4m3 before P @ V (FA3's FP8 forward)."""
    query_rounded: bool = True
    probs_rounded: bool = True

    def describe(self) -> str:
        q = "q, k, v" if self.query_rounded else "k, v"
        return f"{q} rounded to e4m3, P {'rounded to e4m3 (x 2^8)' if self.probs_rounded else 'in float32'}"

    def attention(self, query, key, value, attention_mask, scaling: float, groups: int,
                  softcap: float | None = None) -> torch.Tensor:
        """This rule's attention in float32 on [B, H, Q, D] / [B, Hk, K, D] inputs (an additive mask or None), the
        output divided by the float32 row sum of the unrounded P; [B, Q, H, Dv] in query's dtype."""
        q = (e4m3_round(query.detach()) if self.query_rounded else query.detach()).float()
        k, v = (e4m3_round(t.detach()).float().repeat_interleave(groups, dim=1) for t in (key, value))
        s = q @ k.transpose(-1, -2) * scaling
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if attention_mask is not None:
            s = s + attention_mask.float()
        p = torch.exp(s - s.amax(-1, keepdim=True))
        scale = P_SCALE if self.probs_rounded else 1.0
        weights = (p * scale).to(torch.float8_e4m3fn).float() if self.probs_rounded else p
        out = (weights @ v) / (p.sum(-1, keepdim=True) * scale)
        return out.transpose(1, 2).to(query.dtype)


KV_CANDIDATES = tuple(KvRule(q, p) for q, p in itertools.product((True, False), repeat=2))
DEFAULT_KV = KV_CANDIDATES[0]  # FlashAttention 3's FP8 forward (vLLM's FLASH_ATTN backend on Hopper)


def detect_kv_attention(attention: Callable, dtype: torch.dtype, device, heads: int = 4, kv_heads: int = 2,
                        head_dim: int = 64, tokens: int = 48) -> KvRule | None:
    """attention(q, k, v, mask, scale) -> [B, T, H, Dv] as the operator under test runs it over an FP8 KV cache
    (q [B, H, T, D], k/v [B, Hk, T, D], mask bool [B, 1, T, T], True = attend): one causal sequence, fewer keys
    than a key tile, so a one-pass softmax is what an online one computes."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, tokens, head_dim, generator=g).to(device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads))
    allowed = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]
    additive = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
    scale = head_dim ** -0.5
    with torch.no_grad():
        got = attention(q, k, v, allowed, scale).float().cpu()
    return _pick(got, {r: r.attention(q, k, v, additive, scale, heads // kv_heads).cpu() for r in KV_CANDIDATES})
