"""Kernel providers: where a training module's forward values come from.

A provider computes each operator's forward value and nothing else; the autograd wrappers (autograd.py) add
the backward. `cpu` runs tic's row-invariant CPU kernels (consistent_cpu.py), the ones `kernels: consistent`
uses on both sides; `vllm` (vllm_provider.py) calls the installed vLLM's own kernels on the GPU, the ones
its rollout runs. Both answer the same calls, so every wrapper is tested on CPU in CI.

Shapes (T = tokens of any leading shape, flattened by the caller where a kernel needs it):
  linear(x [.., K], w [N, K], b [N] | None) -> [.., N]
  rms_norm(x [.., D], w [D], eps) -> [.., D]
  add_rms_norm(x, residual, w, eps) -> (rms_norm(x + residual), x + residual)
  cos_sin_cache(hf rotary module, config, P, dtype, device) -> [P, R] (cos | sin halves)
  rotary(q [T, Hq, D], k [T, Hk, D], positions [T], cos_sin [P, R]) -> (q, k)   (neox style, R = rotary dims)
  silu_and_mul(x [.., 2I]) -> silu(x[..., :I]) * x[..., I:], rounded once
  attention(q [B, H, Q, D], k/v [B, Hkv, K, D], mask bool [B, 1, Q, K], scale) -> [B, Q, H, D]
  moe_route(logits [T, E], top_k, renormalize) -> (weights float32 [T, k], ids int64 [T, k])
  moe_experts(x [T, H], weights [T, k], ids [T, k], gate_up [E, 2I, H], down [E, H, I]) -> [T, H]
  log_softmax(logits [T, V]) -> float32 [T, V]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tic.harness.kernels import consistent_cpu as cc


class KernelProvider:
    name = "provider"
    # vLLM runs q/k/v and gate/up as one GEMM each over concatenated weights; a provider that mirrors it says so
    fuse_projections = False


class CPUProvider(KernelProvider):
    """tic's consistent CPU kernels: each token row through the same call with the same shapes."""

    name = "cpu"

    def linear(self, x, w, b=None):
        return cc.row_linear(x, w, b)

    def rms_norm(self, x, w, eps):
        dtype = x.dtype

        def one(r):
            r32 = r.to(torch.float32)
            var = r32.pow(2).mean(-1, keepdim=True)
            return w * (r32 * torch.rsqrt(var + eps)).to(dtype)

        return cc.rowwise(one, x)

    def add_rms_norm(self, x, residual, w, eps):
        total = x + residual
        return self.rms_norm(total, w, eps), total

    def cos_sin_cache(self, rotary, config, n, dtype, device):
        from tic.harness.kernels.modules import hf_cos_sin_cache

        return hf_cos_sin_cache(rotary, n, dtype, device)

    def rotary(self, q, k, positions, cos_sin):
        return rotate_neox(q, positions, cos_sin), rotate_neox(k, positions, cos_sin)

    def silu_and_mul(self, x):
        half = x.shape[-1] // 2
        return cc.rowwise(lambda r: (F.silu(r[:, :half].float()) * r[:, half:].float()).to(x.dtype), x)

    def attention(self, q, k, v, mask, scale):
        return cc.rowwise_attention(None, q, k, v, mask, scale)[0]

    def moe_route(self, logits, top_k, renormalize):
        outs = [route_topk(r, top_k, renormalize) for r in logits.split(1, dim=0)]
        if not outs:
            return logits.new_zeros(0, top_k, dtype=torch.float32), torch.zeros(0, top_k, dtype=torch.long)
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def moe_expert_rows(self, x, e: int, gate_up, down):
        """Expert e's unweighted output for each row of x [n, H], one row per call."""
        return torch.cat([F.linear(self.silu_and_mul(F.linear(r, gate_up[e])), down[e]) for r in x.split(1)]) \
            if x.shape[0] else x.new_zeros(0, x.shape[1])

    def moe_experts(self, x, weights, ids, gate_up, down):
        """The expert-parallel merge rule (tic.harness.engines.parallel.combine_slot_order) one row at a time: each
        slot's output times its weight in the model dtype, summed in fp32 in top-k slot order."""
        dtype, outs = x.dtype, []
        for t in range(x.shape[0]):
            r = x[t:t + 1]
            acc = torch.zeros(1, x.shape[1], dtype=torch.float32)
            for slot in range(ids.shape[1]):
                e = int(ids[t, slot])
                h = F.linear(self.silu_and_mul(F.linear(r, gate_up[e])), down[e])
                acc = acc + (h * weights[t, slot].to(dtype)).to(torch.float32)
            outs.append(acc.to(dtype))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])

    def log_softmax(self, logits):
        return cc.row_log_softmax(logits.float())


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on the first R dims of x [T, H, D] with cos|sin rows looked up per position, in
    x's dtype (HF's apply_rotary_pos_emb arithmetic)."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].to(x.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 softmax, top-k by a stable descending sort (a tie goes to the lower expert id), renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :top_k]
    w = probs.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


_PROVIDERS: dict[str, KernelProvider] = {}


def get_provider(kernels: str) -> KernelProvider:
    """The provider behind `kernels: consistent` (cpu) or `kernels: vllm`."""
    if kernels not in _PROVIDERS:
        if kernels == "consistent":
            _PROVIDERS[kernels] = CPUProvider()
        elif kernels == "vllm":
            from tic.harness.kernels.vllm_provider import VLLMProvider

            _PROVIDERS[kernels] = VLLMProvider()
        else:
            raise ValueError(f"no kernel provider for kernels {kernels!r}")
    return _PROVIDERS[kernels]
