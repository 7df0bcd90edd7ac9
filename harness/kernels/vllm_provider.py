"""The vLLM kernel provider: forward values from the installed vLLM's own kernels (GPU).

Each call goes through vLLM's Python entry points, the ones its model layers use in eager mode, on the layouts
those layers pass: RMSNorm as `_C.rms_norm` (vLLM's `vllm_c` IR implementation; vLLM's batch-invariant Triton
norm when VLLM_BATCH_INVARIANT=1), fused add+RMSNorm through vllm._custom_ops, Gemma's (1 + w) norm as vLLM's
GemmaRMSNorm runs it (vLLM's IR norm with a float32 weight: its native implementation), rotary through
vllm._custom_ops.rotary_embedding, SiLU*mul and GELU-tanh*mul through vLLM's _C silu_and_mul and
gelu_tanh_and_mul, the final logit softcap as vLLM's logits processor computes it, GEMMs through vLLM's unquantized
GEMM dispatch (in batch-invariant mode vLLM's Triton `linear_batch_invariant`, as its linear layers call it), prefill attention
through the varlen entry of vLLM's FlashAttention backend over a paged K/V cache of vLLM's page size (with the
backend's window_size (window - 1, 0) on a sliding layer and its softcap argument), MoE
through vLLM's fused_topk and fused_experts, Mamba-2 mixers through vLLM's causal_conv1d_fn, chunked scan and
gated RMSNorm (tic.harness.kernels.vllm_mamba), logprobs as the rollout's sampler computes them (the V1 runner's
float32 log_softmax, or the V2 runner's Triton kernel: v2_sampler_log_softmax).

Under torch.compile (vLLM's default graph mode) vLLM runs its `native` RMSNorm through Inductor instead of
`_C.rms_norm`; a rollout meant to match this provider runs eager (or pins vLLM's IR op priority to vllm_c).

The bundled patches named in TIC_PATCHES (tic.yaml rollout.patches sets it) are applied in this process
first, so the training forward runs the patched kernels the rollout runs.

In-place kernels (fused_add_rms_norm, rotary_embedding) run on copies: the wrappers' inputs stay intact for
the backward. vLLM is imported when the provider is built, never at tic import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from tic import patches
from tic.core.errors import TicInputError
from tic.harness.kernels.autograd import PLAIN_ACTS, gate_output_ref, layer_norm_float32_written_out
from tic.harness.kernels.memo import TensorMemo
from tic.harness.kernels.routing import as_routing
from tic.harness.kernels.rope import hf_cos_sin_cache
from tic.harness.kernels.spec import KernelProvider, RolloutKernels
from tic.harness.kernels.varlen import paged_layout, paged_rows_layout, varlen_from_mask
from tic.harness.kernels.vllm_fp8 import BlockFp8Linear, fp8_kv_attention, fused_experts_fp8
from tic.harness.kernels.vllm_mamba import VLLMMambaKernels
from tic.patches.plugin import load as load_patches


def require_vllm(device: str = "cuda", load: bool = True) -> None:
    """One-line refusal unless this machine can run vLLM's kernels (CUDA GPU, vLLM importable).
    load=False only looks vLLM up: a check made before the rollout engine starts must not import vLLM, which
    reads its mode (VLLM_BATCH_INVARIANT) once, at import, from a variable that engine sets."""
    if device != "cuda":
        raise TicInputError("kernels: vllm runs vLLM's GPU kernels; set device: cuda")
    if not torch.cuda.is_available():
        raise TicInputError("kernels: vllm needs a CUDA GPU, and torch sees none on this machine")
    if not load:
        if importlib.util.find_spec("vllm") is None:
            raise TicInputError("kernels: vllm needs vLLM installed (not found)")
        return
    try:
        import vllm  # noqa: F401
        from vllm import _custom_ops  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        raise TicInputError(f"kernels: vllm needs vLLM installed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _window_softcap(window: int | None, softcap: float | None) -> dict:
    """The FlashAttention backend's keywords for a sliding window and a softcap, only where set: a full,
    uncapped layer calls the kernel exactly as before."""
    kw = {}
    if window:
        kw["window_size"] = (int(window) - 1, 0)
    if softcap:
        kw["softcap"] = float(softcap)
    return kw


def _build_layout(mask, B: int, T: int, device, block_size: int, window: int | None = None):
    vl = varlen_from_mask(mask, B, T, device, window)
    return vl, paged_rows_layout(vl, B, T, block_size) or paged_layout(vl.cu_seqlens, block_size)


def _rows_as_pages(t: torch.Tensor, pages, block_size: int) -> torch.Tensor:
    """K or V [B, heads, T, D] of a batch whose rows are its pages: [B * row_pages, block_size, heads, D], each row
    padded to whole pages (no copy when the [B, T, heads, D] layout is contiguous and T fills the pages). Slots past
    a sequence's length hold its row's padding tokens' K/V, as a real cache holds stale entries: the kernel reads
    seqused_k keys (the scatter path leaves zeros there; a NaN in a padding token's K/V would show here alone)."""
    rows = t.transpose(1, 2)
    pad = pages.row_pages * block_size - rows.shape[1]
    if pad:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, pad))
    return rows.contiguous().view(-1, block_size, t.shape[1], t.shape[-1])


def _in_pages(t: torch.Tensor, pages, block_size: int) -> torch.Tensor:
    """Packed K or V [N, heads, D] written into a zeroed paged cache [blocks, block_size, heads, D] at its slots."""
    cache = t.new_zeros(pages.num_blocks, block_size, t.shape[1], t.shape[2])
    cache.view(-1, t.shape[1], t.shape[2])[pages.slots] = t
    return cache


def _slots(vl, pages, T: int, block_size: int) -> torch.Tensor:
    """Each packed token's cache slot; a batch whose rows are its pages keeps each row's tokens in its own pages."""
    if pages.slots is not None:
        return pages.slots
    return (vl.index // T) * (pages.row_pages * block_size) + vl.index % T


@contextlib.contextmanager
def _vllm_config_for_custom_ops():
    """The vLLM config a CustomOp reads when it is built: the current one where an engine set it, else vLLM's
    defaults (the ops tic builds only lend their tables and kernels; how vLLM would dispatch them is not used)."""
    from vllm.config import VllmConfig, get_current_vllm_config, set_current_vllm_config

    try:
        get_current_vllm_config()
    except AssertionError:
        with set_current_vllm_config(VllmConfig()):
            yield
        return
    yield


def _table_as_vllm_builds_it(rope, device, dtype) -> torch.Tensor:
    """A get_rope module's cos|sin table computed as vLLM's model loader computes it: on the model's device with
    the model's dtype as default (vLLM builds the table on the GPU). get_rope returns a cached module, maybe built
    on another device (its table then differs in the last bits of some angles: a position near a zero of sin can
    move by 2 bf16 ulps), so the table is computed again here."""
    compute = getattr(rope, "_compute_cos_sin_cache", None)
    if compute is None:
        return rope.cos_sin_cache.to(device=device, dtype=dtype)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype if dtype.is_floating_point else before)
        with torch.device(device):
            return compute().to(dtype)
    finally:
        torch.set_default_dtype(before)


def v2_sampler_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Every token's logprob as vLLM's V2 runner computes the ones it returns: its Triton kernel gives, per row,
    (logit - max) - lse in float32, lse summed block by block in its own order. The kernel is asked for each row's
    top token, whose logit - max is exactly 0, so it hands back -lse itself; every other token is then the same two
    correctly rounded subtractions, so the whole row equals what the kernel would give for any token."""
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    neg_lse = compute_token_logprobs(flat, flat.argmax(dim=-1, keepdim=True))
    out = flat.to(torch.float32, copy=True)  # one float32 [T, V], worked in place (a micro-batch's is GiBs)
    out.sub_(out.amax(dim=-1, keepdim=True)).add_(neg_lse)  # x - lse and x + (-lse) round alike
    return out.reshape(*logits.shape[:-1], logits.shape[-1])


class VLLMProvider(VLLMMambaKernels, KernelProvider):  # Mamba-2 calls: tic.harness.kernels.vllm_mamba
    name = "vllm"
    kernels = "vllm"
    fuse_projections = True

    def __init__(self, rollout: RolloutKernels = RolloutKernels(), kv_cache_dtype: str = "auto"):
        """rollout: what of the vLLM rollout this training forward must match, as its engine resolved it (spec.py):
        prefill attention pages K/V in its page size, since FA3 picks its key tile from the paging, and logprobs
        follow its runner's rule. kv_cache_dtype: the rollout's (fp8: K/V make the FP8 round trip,
        tic.harness.kernels.vllm_fp8)."""
        self.kv_block_size = int(rollout.kv_block_size)
        self.logprob_rule = rollout.logprobs
        self.kv_cache_dtype = kv_cache_dtype
        self._fp8_linears: dict = {}  # (checkpoint, dtype) -> vllm_fp8.BlockFp8Linear
        self._layouts = TensorMemo(_build_layout)  # once per mask: every layer of one forward passes the same one
        self._load_vllm()

    def _load_vllm(self) -> None:
        require_vllm("cuda")
        load_patches()  # the bundled patches named in TIC_PATCHES, as in every vLLM process of the rollout
        self.patches = sorted(patches.active())
        from vllm import _custom_ops as vops
        import vllm.envs as envs

        self.vops = vops
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)  # vLLM 0.26 reads its mode from here
        if self.batch_invariant:
            from vllm.model_executor.layers.batch_invariant import init_batch_invariance

            try:
                init_batch_invariance()
            except TypeError:  # releases that take the attention backend
                init_batch_invariance(None)
        self._gemm = self._find_gemm(self.batch_invariant)
        self.fa_version = self._find_fa_version()

    # -- lookups that moved between vLLM releases ----------------------------------------------------------
    @staticmethod
    def _find_gemm(batch_invariant: bool = False):
        """The GEMM vLLM's UnquantizedLinearMethod (and lm_head) runs: in batch-invariant mode on CUDA its Triton
        `linear_batch_invariant` (called directly, not through aten), else the unquantized GEMM dispatch (where
        tic's gemm-fixed-m patch sits)."""
        if batch_invariant:
            try:
                from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

                return linear_batch_invariant
            except ImportError:
                pass
        try:
            from vllm.model_executor.layers.utils import dispatch_unquantized_gemm

            gemm = dispatch_unquantized_gemm()
            layer = torch.nn.Module()
            return lambda x, w, b: gemm(layer, x, w, b)
        except ImportError:
            return torch.nn.functional.linear

    @staticmethod
    def _find_varlen_attention():
        """The varlen entry point as vLLM's FlashAttention backend holds it (where tic's fa3 patch pins it),
        else vllm.vllm_flash_attn's."""
        try:
            from vllm.v1.attention.backends import flash_attn as backend

            return backend.flash_attn_varlen_func
        except (ImportError, AttributeError):
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func

    @staticmethod
    def _find_fa_version() -> int:
        for mod in ("vllm.v1.attention.backends.fa_utils", "vllm.attention.utils.fa_utils"):
            try:
                return int(__import__(mod, fromlist=["get_flash_attn_version"]).get_flash_attn_version())
            except (ImportError, AttributeError, TypeError):
                continue
        return int(os.environ.get("VLLM_FLASH_ATTN_VERSION", "2"))

    # -- kernels -----------------------------------------------------------------------------------------------
    def linear(self, x, w, b=None):
        return self._gemm(x, w, b)

    def gemma_rms_norm(self, x, w, eps, residual=None):
        """vLLM's GemmaRMSNorm as 0.26 runs it: its IR ops rms_norm / fused_add_rms_norm with the float32 weight
        (1 + w), which the vllm_c CUDA kernel refuses, so vLLM runs the op's native implementation (where tic's
        rmsnorm patch puts its fixed-order row kernel); on the layout vLLM's Gemma layers give it ([tokens,
        hidden], or [tokens, heads, head_dim] for q/k norms)."""
        from vllm import ir

        shape = x.shape
        flat = (lambda t: t.flatten(0, 1)) if x.dim() == 4 else (lambda t: t.reshape(-1, shape[-1]))  # noqa: E731
        weight = w.float() + 1.0  # GemmaRMSNorm.forward_native's weight
        if residual is None:
            return ir.ops.rms_norm(flat(x), weight, eps).reshape(shape)
        out, res = ir.ops.fused_add_rms_norm(flat(x), flat(residual), weight, eps)  # functional: inputs intact
        return out.reshape(shape), res.reshape(shape)

    def rms_norm(self, x, w, eps, offset: float = 0.0):
        """vLLM's `_C.rms_norm` (its eager IR implementation `vllm_c`), through vllm._custom_ops, on the layout
        vLLM's layers give it: a
        hidden-state norm sees [tokens, hidden]; a per-head norm (Qwen3's q_norm/k_norm) sees the strided
        [tokens, heads, head_dim] view of the fused qkv output, as Qwen3Attention passes it; a whole-projection
        norm (OLMoE's) the strided [tokens, heads * head_dim] view, as OlmoeAttention passes it. offset 1: Gemma's
        norm (gemma_rms_norm)."""
        if offset:
            return self.gemma_rms_norm(x, w, eps)
        shape = x.shape
        if self.batch_invariant:  # vLLM's batch-invariant RMSNorm (a Triton kernel)
            from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

            return rms_norm_batch_invariant(x.reshape(-1, shape[-1]).contiguous(), w, eps).reshape(shape)
        xv = x.flatten(0, 1) if x.dim() == 4 else x.reshape(-1, shape[-1])
        out = torch.empty(xv.shape, dtype=x.dtype, device=x.device)
        self.vops.rms_norm(out, xv, w, eps)  # vllm._custom_ops: where tic's rmsnorm patch pins the launch
        return out.reshape(shape)

    def add_rms_norm(self, x, residual, w, eps, offset: float = 0.0):
        """`_C.fused_add_rms_norm` through vllm._custom_ops, where vLLM's IR implementation and its
        batch-invariant norm both end (and where tic's rmsnorm patch pins the launch); on copies, as it works
        in place. offset 1: Gemma's norm (gemma_rms_norm)."""
        if offset:
            return self.gemma_rms_norm(x, w, eps, residual)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).clone()
        r2 = residual.reshape(-1, shape[-1]).clone()
        self.vops.fused_add_rms_norm(x2, r2, w, eps)
        return x2.reshape(shape), r2.reshape(shape)

    rope_source = "not built yet"

    def cos_sin_cache(self, rotary, config, n, dtype, device, layer_type=None):
        """vLLM's own cos|sin cache (get_rope, as its model layers build it) when this release's get_rope takes
        the model's rope parameters; else the table from the HF rotary module (rope_source says which).
        layer_type: the table of one layer type, from rope_parameters[layer_type] (Gemma-3: local and global
        bases)."""
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        max_pos = max(n, int(getattr(config, "max_position_embeddings", n)))
        hf = hf_cos_sin_cache(rotary, n, dtype, device, layer_type)  # the fallback, and what vLLM's is checked by
        try:
            from vllm.model_executor.layers.rotary_embedding import get_rope
        except ImportError as e:
            return self._hf_table(f"no get_rope ({e})", hf)
        params = getattr(config, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        if layer_type is not None:
            params = params[layer_type]
        attempts = [dict(max_position=max_pos, is_neox_style=True, rope_parameters=dict(params), dtype=dtype),
                    dict(rotary_dim=head, max_position=max_pos, is_neox_style=True,
                         rope_parameters=dict(params), dtype=dtype)]
        rope = None
        with _vllm_config_for_custom_ops():  # get_rope builds a CustomOp, which reads the current vLLM config
            for kwargs in attempts:
                try:
                    rope = get_rope(head, **kwargs)
                    break
                except TypeError as e:  # signatures moved between releases
                    why = f"get_rope: {e}"
        if rope is None:
            return self._hf_table(why, hf)
        cache = _table_as_vllm_builds_it(rope, device, dtype)
        # the same rotary as the model's own module (width, scaling), up to the last bits: a generic get_rope call
        # can build another one (a partial rotary read from a field it does not take), then the HF table serves
        if cache.shape[1:] != hf.shape[1:] or cache.shape[0] < n or \
                not torch.allclose(cache[:n].float(), hf.float(), rtol=0, atol=1e-2):
            return self._hf_table(f"get_rope built another table (shape {tuple(cache.shape)}) than the model's "
                                  f"rotary module (shape {tuple(hf.shape)})", hf)
        self.rope_source = f"vllm get_rope, computed on {torch.device(device)}"
        return cache

    def _hf_table(self, why: str, table: torch.Tensor) -> torch.Tensor:
        """The HF rotary module's table, where tic cannot build vLLM's own through get_rope (said in rope_source,
        and on stderr: the two can differ in the last bits of some angles)."""
        import sys

        self.rope_source = f"hf rotary module ({why[:120]})"
        print(f"tic: kernels: vllm reads the rotary table from the HF module: {why[:120]}", file=sys.stderr)
        return table

    def rotary(self, q, k, positions, cos_sin, neox: bool = True):
        T, Hq, D = q.shape
        qo = q.reshape(T, Hq * D).clone()
        ko = k.reshape(T, -1).clone()
        self.vops.rotary_embedding(positions, qo, ko, D, cos_sin.to(q.dtype), neox)
        return qo.reshape(q.shape), ko.reshape(k.shape)

    def rotary_interleaved(self, q, k, positions, cos_sin):
        """vLLM's rotary kernel with is_neox_style False, as its GLM layers run it (the same cos|sin cache)."""
        return self.rotary(q, k, positions, cos_sin, neox=False)

    @staticmethod
    def _act_and_mul(kernel, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        out = torch.empty(x2.shape[0], shape[-1] // 2, dtype=x.dtype, device=x.device)
        kernel(out, x2)
        return out.reshape(*shape[:-1], shape[-1] // 2)

    def silu_and_mul(self, x):
        return self._act_and_mul(torch.ops._C.silu_and_mul, x)

    def gelu_tanh_and_mul(self, x):
        """vLLM's GeluAndMul(approximate="tanh") on CUDA: _C.gelu_tanh_and_mul (Gemma's MLP)."""
        return self._act_and_mul(torch.ops._C.gelu_tanh_and_mul, x)

    def softcap(self, x, cap):
        """The final logit softcap as vLLM's LogitsProcessor applies it to the model-dtype logits: divide,
        tanh, multiply (elementwise on the GPU: a row's bits do not depend on its neighbours)."""
        return torch.tanh(x / cap) * cap

    def activation(self, x, kind):
        """An ungated MLP's activation: the torch function vLLM's get_act_fn gives for gelu, gelu_pytorch_tanh,
        relu and silu on CUDA; for relu2 torch's relu then square, the bits of vLLM's _C.relu_squared (float32
        square of the clamped value, rounded once). Elementwise: a row's bits do not follow the batch."""
        return PLAIN_ACTS[kind](x)

    def layer_norm(self, x, w, b, eps):
        """nn.LayerNorm as vLLM's models call it (torch's kernel: one block per row, so a row's bits do not follow
        the batch)."""
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)

    def layer_norm_float32(self, x, w, b, eps):
        """A LayerNorm written out in float32 (CohereLayerNorm): vLLM's commandr.layer_norm_func itself, as the
        module holds it at the call (a rollout patch of it, layernorm-float32-rows, reaches this side too). It has
        no bias; with one, the formula written out in torch ops."""
        if b is not None:
            return layer_norm_float32_written_out(x, w, b, eps)
        from vllm.model_executor.models import commandr

        return commandr.layer_norm_func(x, w, eps)

    def output_gate(self, g, y, function, per_head):
        """An attention output times its gate's function, elementwise torch ops in float32 then the model dtype, as
        the models' own forwards gate it (vLLM's Qwen3-Next likewise multiplies by torch.sigmoid of its gate)."""
        return gate_output_ref(g, y, function, per_head)

    def sigmoid_gate(self, g, y):
        """A shared expert's gate as vLLM's Qwen2MoeMLP applies it: F.sigmoid(gate(x)) * out, elementwise in the
        model dtype."""
        return torch.sigmoid(g) * y

    def _layout(self, mask, B: int, T: int, device, block_size: int, window: int | None = None):
        """(varlen, paged layout) for one mask, built once per mask (tic.harness.kernels.memo.TensorMemo)."""
        return self._layouts.get(mask, B, T, device, block_size, window)

    def attention(self, q, k, v, mask, scale, softcap=None, window=None):
        """Prefill attention as vLLM's FlashAttention backend runs it: the K/V written into a paged cache of
        vLLM's page size and read back through a block table (FA3 picks its key tile from whether K/V are
        paged), through the backend module's varlen entry point (where tic's fa3 patch pins the launch). A
        sliding layer passes the backend's window_size (window - 1, 0) (its mask must be that window:
        varlen_from_mask checks it); softcap as the backend's logits_soft_cap (0: none)."""
        flash_attn_varlen_func = self._find_varlen_attention()
        B, H, T, D = q.shape
        bs = self.kv_block_size
        vl, pages = self._layout(mask, B, T, q.device, bs, window)
        flat = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], t.shape[-1])[vl.index].contiguous()  # noqa: E731
        qf = flat(q)
        kw = dict(cu_seqlens_q=vl.cu_seqlens, max_seqlen_q=vl.max_seqlen, seqused_k=pages.seq_lens,
                  max_seqlen_k=vl.max_seqlen, softmax_scale=scale, causal=True, block_table=pages.block_table,
                  fa_version=self.fa_version, **_window_softcap(window, softcap))
        if self.kv_cache_dtype.startswith("fp8"):  # FP8 KV cache: tic.harness.kernels.vllm_fp8
            out = fp8_kv_attention(self.vops, flash_attn_varlen_func, qf, flat(k), flat(v),
                                   _slots(vl, pages, T, bs), pages, bs, **kw)
        else:
            if pages.row_pages:
                k_cache, v_cache = (_rows_as_pages(t, pages, bs) for t in (k, v))
            else:
                k_cache, v_cache = (_in_pages(flat(t), pages, bs) for t in (k, v))
            out = flash_attn_varlen_func(q=qf, k=k_cache, v=v_cache, **kw)
        full = torch.zeros(B * T, H, v.shape[-1], dtype=out.dtype, device=out.device)
        full[vl.index] = out
        return full.reshape(B, T, H, v.shape[-1])

    def moe_route(self, logits, top_k, routing, bias=None):
        from vllm.model_executor.layers.fused_moe import fused_topk

        rule = as_routing(routing)
        if not rule.plain:  # coverage refuses these for kernels: vllm (moe:score_router), so no run gets here
            raise ValueError(f"vLLM's provider routes softmax top-k routers only, not {rule.describe()}")
        r = fused_topk(logits, logits, top_k, rule.renormalize)
        return r[0].float(), r[1].long()

    def moe_experts(self, x, weights, ids, gate_up, down):
        from vllm.model_executor.layers.fused_moe import fused_experts

        # experts stored as (in, out) arrive as transposed views: vLLM's kernel reads [E, 2I, H] rows, as vLLM's
        # loader lays them out on the rollout side
        gate_up, down = gate_up.contiguous(), down.contiguous()
        return fused_experts(x.contiguous(), gate_up, down, weights, ids.to(torch.int32))  # 0.26: out of place

    def log_softmax(self, logits):
        if self.logprob_rule == "v2_sampler":
            return v2_sampler_log_softmax(logits)
        return logits.log_softmax(dim=-1, dtype=torch.float32)  # the V1 runner's sampler

    # -- block FP8 (tic.harness.kernels.fp8 calls these; vLLM's own entry points in vllm_fp8) --------------------
    def fp8_linear(self, x, wq, ws, b, block, checkpoint=None):
        if checkpoint is None:
            raise ValueError("vLLM's block-FP8 linear needs the checkpoint its copies come from (its quantization "
                             "config is the rollout's)")
        key = (str(checkpoint), x.dtype)
        if key not in self._fp8_linears:
            self._fp8_linears[key] = BlockFp8Linear(checkpoint, x.dtype)
        return self._fp8_linears[key](x, wq, ws, b)

    def fp8_moe_experts(self, x, weights, ids, gu_q, gu_s, d_q, d_s, block, with_intermediate: bool = False):
        return fused_experts_fp8(x, weights, ids, gu_q, gu_s, d_q, d_s, block, with_intermediate)
