"""The einsum Mamba-2 scan tic's references run (tic.harness.measure.ssd_reference): its values against the
single-step recurrence, its largest intermediate, and its swap into a transformers model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tic.harness.kernels.mamba import mamba_scan_ref
from tic.harness.measure import ssd_reference
from tic.harness.measure.ssd_reference import chunk_scan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _inputs(T: int, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(T, H, P), r(T, H), r(T, G, N), r(T, G, N), r(H) * 0.5, r(H) * 0.5, r(H), r(H, P, N) * 0.3


@pytest.mark.parametrize("T, chunk", [(12, 4), (11, 4), (9, 16), (1, 3)])
def test_chunk_scan_is_the_recurrence(T, chunk):
    x, dt, B, C, A_log, dt_bias, D, S0 = _inputs(T)
    A = -torch.exp(A_log)
    y, final = chunk_scan(x[None], dt[None], A, B[None], C[None], chunk, D=D, dt_bias=dt_bias, initial_states=S0[None],
                          dt_softplus=True, return_final_states=True)
    empty = lambda *s: torch.zeros(0, *s)  # noqa: E731
    want, at_boundary = mamba_scan_ref(x, dt, B, C, A_log, dt_bias, D, S0, empty(4, 3), empty(4), empty(2, 5),
                                       chunk_size=max(T, 1), dt_min=0.0, dt_max=float("inf"))
    assert torch.allclose(y[0], want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(final[0], at_boundary, atol=1e-5, rtol=1e-5)  # one chunk of T: the boundary is the end


def test_chunk_scan_limits_dt_and_drops_d_when_absent():
    x, dt, B, C, A_log, dt_bias, D, S0 = _inputs(10)
    y = chunk_scan(x[None], dt[None], -torch.exp(A_log), B[None], C[None], 4, dt_bias=dt_bias, dt_softplus=True,
                   dt_limit=(0.1, 0.5))
    empty = lambda *s: torch.zeros(0, *s)  # noqa: E731
    want, _ = mamba_scan_ref(x, dt, B, C, A_log, dt_bias, torch.zeros_like(D), torch.zeros_like(S0), empty(4, 3),
                             empty(4), empty(2, 5), chunk_size=4, dt_min=0.1, dt_max=0.5)
    assert torch.allclose(y[0], want, atol=1e-5, rtol=1e-5)


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _broadcast_scores(C, B):
    """The form some transformers releases use for C.B: a positions x positions x state product, then a sum."""
    return (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)


@pytest.mark.parametrize("planted", [False, True])
def test_no_intermediate_holds_positions_squared_times_state(planted, monkeypatch):
    """On 256 tokens in chunks of 64 with a 32-wide state, the largest tensor is the chunk's position x position
    scores per head, a state's width below the broadcast form's; planting that form must break the bound."""
    T, H, P, G, N, chunk = 256, 4, 8, 1, 32, 64
    x, dt, B, C, A_log, dt_bias, D, _ = _inputs(T, H, P, G, N)
    if planted:
        real = torch.einsum

        def einsum(eq, *ops):
            if eq == "bclhn,bcshn->bhcls":
                return _broadcast_scores(*ops).permute(0, 4, 1, 2, 3)
            return real(eq, *ops)
        monkeypatch.setattr(ssd_reference.torch, "einsum", einsum)
    with _LargestOutput() as seen:
        chunk_scan(x[None], dt[None], -torch.exp(A_log), B[None], C[None], chunk, D=D, dt_bias=dt_bias,
                   dt_softplus=True)
    scores = (T // chunk) * chunk * chunk * H
    assert (seen.numel > scores) == planted, (seen.numel, scores)


@pytest.mark.parametrize("name", ["tiny-nemotron-h", "tiny-mamba2"])
def test_lean_scans_swaps_the_models_scan_and_restores_it(name, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(EXAMPLES / name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]])
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits
    calls = []
    monkeypatch.setattr(ssd_reference, "chunk_scan", lambda *a, **k: calls.append(1) or chunk_scan(*a, **k))
    module = __import__(type(model).__module__, fromlist=["_"])
    original = getattr(module, ssd_reference.SCAN_NAME)
    with ssd_reference.lean_scans(model) as switched, torch.no_grad():
        lean = model(input_ids=ids, use_cache=False).logits
    assert switched == 1 and calls  # the model's mixers ran the swapped scan
    assert getattr(module, ssd_reference.SCAN_NAME) is original
    assert torch.allclose(lean, own, atol=1e-5, rtol=1e-4)


def test_lean_scans_leaves_a_model_without_the_scan_alone():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(EXAMPLES / "tiny-qwen3"))
    with ssd_reference.lean_scans(model) as switched:
        assert switched == 0
