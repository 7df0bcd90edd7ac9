"""The mamba1-prefill-steps patch and the vLLM provider's mamba1_scan on CPU, against a stand-in of vLLM 0.26's
MambaMixer and its kernels (tests/support/tic_fake_vllm.py: a selective-scan prefill that composes the states in
another order, a decode kernel whose launch config, and with it the order of its sum over the state, follows a
table keyed by the batch, and a decode conv that sums its taps in another order). Requests go through vLLM-style
steps (tests/support/tic_mixer_serving.py): with the patch every token's output equals its request's whole
sequence prefilled alone; without it, decoded tokens differ. The training side's scan is the rollout's prefill bit
for bit. The GPU run validates vLLM's kernels."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tic import patches

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_mixer_serving import serve  # noqa: E402

DIM, N, R, K, LINES = 6, 3, 2, 4, 5


def _mixer(seed=0):
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer

    g = torch.Generator().manual_seed(seed)
    m = MambaMixer()
    m.prefix, m.R, m.N = "mixer", R, N
    m.conv_weights, m.bias = 0.5 * torch.randn(DIM, K, generator=g), 0.1 * torch.randn(DIM, generator=g)
    m.x_proj, m.dt_proj = 0.5 * torch.randn(R + 2 * N, DIM, generator=g), 0.5 * torch.randn(DIM, R, generator=g)
    m.dt_bias, m.D = 0.3 * torch.randn(DIM, generator=g), torch.randn(DIM, generator=g)
    m.A = -torch.exp(torch.rand(DIM, N, generator=g))
    m.kv_cache = (torch.zeros(LINES, K - 1, DIM), torch.zeros(LINES, DIM, N))
    return m


def _step(m, decodes, prefills):
    """One vLLM step: decodes [(line, row [2 DIM])] first, then prefills [(line, computed, rows [n, 2 DIM])]; the
    projection as vLLM's mixer holds it (channel-last [2 DIM, tokens]). Returns the mixer's rows [tokens, DIM]."""
    from vllm.forward_context import ForwardContext, set_forward_context

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cu = [0]
    for _, _, rows in prefills:
        cu.append(cu[-1] + rows.shape[0])
    meta = SimpleNamespace(num_decode_tokens=len(decodes), num_prefill_tokens=cu[-1], query_start_loc_p=i32(cu),
                           state_indices_tensor_p=i32([p[0] for p in prefills]),
                           has_initial_states_p=torch.tensor([p[1] > 0 for p in prefills]),
                           state_indices_tensor_d=i32([d[0] for d in decodes]))
    projected = torch.cat([d[1][None] for d in decodes] + [p[2] for p in prefills])
    hidden_states_BC, gate = projected.t().chunk(2, dim=0)
    set_forward_context(ForwardContext({"mixer": meta}))
    return m.ssm_forward(hidden_states_BC, gate.clone()).t()


def test_decode_and_a_continued_prefill_equal_the_whole_sequence_prefilled(fake_vllm):
    from vllm.model_executor.layers.mamba.ops import mamba_ssm

    g = torch.Generator().manual_seed(1)
    seqs = tuple(torch.randn(n, 2 * DIM, generator=g) for n in (14, 12, 8))
    stock_whole = [_step(_mixer(), [], [(2, 0, t)]) for t in seqs]
    stock = serve(_step, _mixer(), *seqs)
    for mine, ref, prefilled in zip(stock, stock_whole, (5, 6, 2)):
        assert torch.equal(mine[:prefilled], ref[:prefilled])  # the first prefills
        assert not torch.equal(mine[prefilled:], ref[prefilled:])  # the control: vLLM's own steps differ
    patches.apply(["mamba1-prefill-steps"])
    try:
        assert patches.active() == ["mamba1-prefill-steps"]
        whole = [_step(_mixer(), [], [(2, 0, t)]) for t in seqs]  # each request prefilled alone
        mamba_ssm.CONFIGS.clear()
        got = serve(_step, _mixer(), *seqs)
        for mine, ref in zip(got, whole):
            assert mine.shape == ref.shape and torch.equal(mine, ref), (mine - ref).abs().amax(-1)
        assert set(mamba_ssm.CONFIGS) == {(32, 4)}  # the batch-free default launch, 1 to 3 rows alike
    finally:
        patches.apply([])
    assert patches.active() == []
    mamba_ssm.CONFIGS.clear()
    _step(_mixer(), [], [(2, 0, seqs[0][:3])])
    assert mamba_ssm.try_get_optimal_ssm_config(DIM, N, 1, 1, "float32", False) == (16, 8)  # reverted


def test_prefix_caching_stops_the_prefill_with_the_reason(fake_vllm):
    from tic.patches.vllm.mamba1_prefill_steps import _steps

    scan = _steps(lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="mamba1-prefill-steps: prefix caching"):
        scan(*(torch.zeros(1),) * 6, block_idx_first_scheduled_token=torch.zeros(1))


def _scan_inputs(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(u=r(n, DIM), dt_raw=0.5 * r(n, DIM), B=r(n, N), C=r(n, N), z=r(n, DIM), A_log=0.3 * r(DIM, N),
                D=r(DIM), dt_bias=0.2 * r(DIM), state=0.5 * r(DIM, N))


def test_the_training_sides_scan_is_the_rollouts_prefill_bit_for_bit(fake_vllm):
    """The vLLM provider's mamba1_scan (the training forward) against the patch's prefill of the same tokens from
    the same state, and a sequence split in two against it whole; vLLM's own prefill (the control) differs."""
    from vllm.model_executor.layers.mamba import mamba_mixer
    from vllm.model_executor.layers.mamba.ops import mamba_ssm

    from tic.harness.kernels.vllm_mamba import VLLMMambaKernels
    from tic.patches.vllm.mamba1_prefill_steps import prefill_as_steps

    x = _scan_inputs(7)
    A = -torch.exp(x["A_log"].float())
    patches.apply(["mamba1-prefill-steps"])
    try:
        y, S = VLLMMambaKernels().mamba1_scan(*x.values())

        def rollout(scan):  # one sequence in cache line 2, continuing from the state there
            lines = torch.zeros(LINES, DIM, N)
            lines[2] = x["state"]
            z = x["z"].t().clone()
            out = scan(x["u"].t(), lines, x["dt_raw"].t(), A, x["B"].t(), x["C"].t(), x["D"].float(), z,
                       x["dt_bias"], True, torch.tensor([0, 7], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32), torch.tensor([True]))
            return out.t(), lines[2]

        steps = lambda *a: prefill_as_steps(*a, mamba_mixer.selective_state_update)  # noqa: E731
        got, state = rollout(steps)
        assert torch.equal(y, got) and torch.equal(S, state)
        first = {k: (v[:4] if v.shape[0] == 7 and k not in ("A_log", "state") else v) for k, v in x.items()}
        y1, S1 = VLLMMambaKernels().mamba1_scan(*first.values())
        rest = {k: (v[4:] if v.shape[0] == 7 and k not in ("A_log", "state") else v) for k, v in x.items()}
        y2, S2 = VLLMMambaKernels().mamba1_scan(*{**rest, "state": S1}.values())
        assert torch.equal(torch.cat([y1, y2]), y) and torch.equal(S2, S)
        stock = lambda *a: mamba_ssm.selective_scan_fn(*a[:10], query_start_loc=a[10], cache_indices=a[11],  # noqa: E731
                                                       has_initial_state=a[12])
        assert not torch.equal(rollout(stock)[0], y)
    finally:
        patches.apply([])
