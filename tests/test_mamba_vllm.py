"""The vLLM provider's Mamba-2 calls on CPU, vLLM's entry points stood in (tests/support/tic_fake_vllm.py: they
check the layouts vLLM's kernels assert and compute the chunked scan with every reduction padded to the chunk, as
the kernel's tiles do). What runs here is the plumbing: the layouts and flags MambaMixer2 passes, the replay of the
current chunk in decode, the start state carried. The GPU run validates vLLM's kernels themselves."""

from __future__ import annotations

import pytest
import torch

from tic.config.schema import load_config
from tic.harness.engines import hf
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.modules import apply
from tic.harness.kernels.vllm_mamba import VLLMMambaKernels
from tic.skill.context import GateContext


class MambaOnVLLM(VLLMMambaKernels, CPUProvider):
    """tic's CPU kernels, the Mamba-2 calls through (stand-in) vLLM's entry points."""


class ReplayWithoutBuffer(MambaOnVLLM):
    """A broken replay: decode runs the scan from the chunk's start state without the chunk's earlier tokens."""

    def mamba_scan(self, x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x, buf_dt, buf_B, **kw):
        return super().mamba_scan(x, dt_raw, B, C, A_log, dt_bias, D, state, buf_x[:0], buf_dt[:0], buf_B[:0], **kw)


def _model(example, name, provider):
    ctx = GateContext(load_config(example(name) / "tic-consistent.yaml"))
    return apply(hf.load_model(ctx.model.dir, "float32", kernels="stock", shared=False), provider)


def _prefill_then_decode(model, ids, prefix):
    from transformers import DynamicCache

    from tic.harness.engines.hf import cache_kwargs

    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :prefix], position_ids=torch.arange(prefix)[None], use_cache=True,
                       **cache_kwargs(model, cache)).logits]
        for t in range(prefix, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t]]), use_cache=True,
                               **cache_kwargs(model, cache)).logits)
    return whole, torch.cat(steps, dim=1)


IDS = torch.tensor([[5, 9, 33, 2, 71, 18, 4, 90, 61, 7, 12, 40, 3]])  # chunk_size 4: boundaries at 4, 8, 12


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-nemotron-h"])
def test_decode_replays_the_current_chunk_through_vllms_scan(fake_vllm, example, name):
    from vllm.model_executor.layers.mamba.ops import causal_conv1d, ssd_combined

    model = _model(example, name, MambaOnVLLM())
    causal_conv1d.CALLS.clear(), ssd_combined.CALLS.clear()
    whole, stepped = _prefill_then_decode(model, IDS, prefix=6)
    assert torch.equal(stepped, whole)
    scans, convs = ssd_combined.CALLS, causal_conv1d.CALLS
    n_mixers = sum(1 for m in model.modules() if hasattr(m, "_tic_layout"))
    full, prefill = scans[:n_mixers], scans[n_mixers:2 * n_mixers]
    assert all(c["chunks"] == [0, 4, 8, 12, 13] and not c["initial"] for c in full)  # from the first token
    assert all(c["dt_softplus"] and c["z"] is None and c["state_dtype"] == torch.float32
               and c["dt_limit"] == (0.0, float("inf"))
               and c["A_dtype"] == torch.float32 for c in scans)
    assert all(c["chunks"] == [0, 4, 6] for c in prefill)
    # decode of token 6 replays tokens 4-5 from the start state of chunk 1; token 8 starts chunk 2 alone
    at = lambda t: scans[(2 + t - 6) * n_mixers]  # noqa: E731
    assert at(6)["chunks"] == [0, 3] and at(6)["initial"]
    assert at(8)["chunks"] == [0, 1] and at(11)["chunks"] == [0, 4]
    assert not any(c["has_initial_state"][0] for c in convs[:2 * n_mixers])  # sequence starts: no conv state
    assert all(c["has_initial_state"] == [True] and c["activation"] == "silu" for c in convs[2 * n_mixers:])


def test_a_replay_without_the_chunks_earlier_tokens_differs(fake_vllm, example):
    """The control of the test above: decode that drops the buffered tokens does not reproduce prefill."""
    whole, stepped = _prefill_then_decode(_model(example, "tiny-mamba2", ReplayWithoutBuffer()), IDS, prefix=6)
    assert torch.equal(stepped[:, :6], whole[:, :6]) and not torch.equal(stepped, whole)


def test_gated_norm_takes_vllms_triton_kernel_for_one_group_and_its_torch_path_for_several(fake_vllm):
    from vllm.model_executor.layers.mamba.ops import layernorm_gated

    prov, g = MambaOnVLLM(), torch.Generator().manual_seed(0)
    y, gate, w = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    w = w[0, 0].bfloat16()  # vLLM holds the norm weight in the model dtype
    layernorm_gated.CALLS.clear()
    one = prov.gated_rms_norm(y, gate, w, group_size=8, eps=1e-5, out_dtype=torch.bfloat16)
    assert layernorm_gated.CALLS == [dict(shape=(6, 8), group_size=None, norm_before_gate=False)]
    two = prov.gated_rms_norm(y, gate, w, group_size=4, eps=1e-5, out_dtype=torch.bfloat16)
    assert len(layernorm_gated.CALLS) == 1 and one.shape == two.shape == y.shape and two.dtype == torch.bfloat16
    # forward_native: float32 x * silu(gate), per-group RMS, rounded to the model dtype, then times the weight
    h = y.to(torch.bfloat16).float() * torch.nn.functional.silu(gate.float())
    grouped = h.view(2, 3, 2, 4)
    want = w * (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-5)).view(h.shape).bfloat16()
    assert torch.equal(two, want)


def test_grouped_gated_norm_patch_sends_several_groups_to_the_triton_kernel_on_both_sides(fake_vllm):
    """mamba-gated-norm-triton: vLLM's Mixer2RMSNormGated (several groups) and the training provider, which calls
    vLLM's own forward_cuda, both take rms_norm_gated with the group size; reverted, both go back to torch's
    forward_native; one group is untouched."""
    from tic import patches
    from vllm.model_executor.layers.mamba.ops import layernorm_gated

    prov, g = MambaOnVLLM(), torch.Generator().manual_seed(0)
    y, gate = (torch.randn(2, 3, 8, generator=g) for _ in range(2))
    w = torch.randn(8, generator=g).bfloat16()
    native = prov.gated_rms_norm(y, gate, w, group_size=4, eps=1e-5, out_dtype=torch.bfloat16)
    layernorm_gated.CALLS.clear()
    patches.apply(["mamba-gated-norm-triton"])
    assert patches.registry()["mamba-gated-norm-triton"].is_applied()
    patches.apply(["mamba-gated-norm-triton"])  # idempotent: one wrapper
    grouped = prov.gated_rms_norm(y, gate, w, group_size=4, eps=1e-5, out_dtype=torch.bfloat16)
    assert layernorm_gated.CALLS == [dict(shape=(6, 8), group_size=4, norm_before_gate=False)]
    h = y.to(torch.bfloat16).float() * torch.nn.functional.silu(gate.float())
    grp = h.view(2, 3, 2, 4)
    want = ((grp * torch.rsqrt(grp.pow(2).mean(-1, keepdim=True) + 1e-5)).view(h.shape) * w.float()).bfloat16()
    assert torch.equal(grouped, want) and not torch.equal(grouped, native)  # the weight applied in float32 here
    prov.gated_rms_norm(y, gate, w, group_size=8, eps=1e-5, out_dtype=torch.bfloat16)
    assert layernorm_gated.CALLS[-1]["group_size"] == 8
    patches.apply([])
    layernorm_gated.CALLS.clear()
    assert torch.equal(prov.gated_rms_norm(y, gate, w, group_size=4, eps=1e-5, out_dtype=torch.bfloat16), native)
    assert layernorm_gated.CALLS == []


def test_the_conv_state_never_sits_in_vllms_null_block(fake_vllm):
    """vLLM reserves conv cache line NULL_BLOCK_ID (0) for padding: its kernel skips a sequence mapped there and
    leaves the output unwritten (the stand-in: NaN). A fresh and a continued sequence both come back as the
    float32 reference computes them."""
    from tic.harness.kernels.mamba import mamba_conv_ref

    g = torch.Generator().manual_seed(0)
    u, w, b = torch.randn(9, 6, generator=g), 0.5 * torch.randn(6, 1, 4, generator=g), 0.1 * torch.randn(6, generator=g)
    for window in (torch.zeros(3, 6), torch.randn(3, 6, generator=g)):
        out = MambaOnVLLM().mamba_conv(u, window, w, b)
        assert torch.isfinite(out).all()
        assert torch.allclose(out, mamba_conv_ref(u, window, w, b), atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-jamba"])
def test_mamba1_runs_vllms_decode_kernel_token_by_token(fake_vllm, example, name):
    """A Mamba-1 model on the provider's mamba1_scan (vLLM's selective_state_update, stood in): prefill then
    decode equals the whole sequence, every launch in vLLM's batch-free default config."""
    from vllm.model_executor.layers.mamba.ops import mamba_ssm

    model = _model(example, name, MambaOnVLLM())
    mamba_ssm.CONFIGS.clear()
    whole, stepped = _prefill_then_decode(model, IDS, prefix=6)
    assert torch.equal(stepped, whole)
    assert mamba_ssm.CONFIGS and set(mamba_ssm.CONFIGS) == {(32, 4)}
