"""Bundled vLLM patches on the CPU: metadata, version refusal, apply/revert, the plugin entry point, and what each
patch changes, against a stand-in vLLM with the same module paths (the GPU runs are docs/results/vllm-patches.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tic import patches
from tic.core.errors import TicInputError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from tic_fake_vllm import make_fake_vllm  # noqa: E402
# gemm-fixed-order excludes gemm-fixed-m, rmsnorm-rows rmsnorm-fixed-block
ALL = sorted(n for n in patches.registry() if n not in ("gemm-fixed-m", "rmsnorm-rows"))

def _define_block_dependent_rmsnorm():
    """A CPU stand-in for vLLM's `_C.fused_add_rms_norm` with the launcher's flaw made loud: below 256 rows the
    sum of squares goes through another reduction (here: 1024-wide partials rounded to bfloat16), above it
    256-wide float32 partials, so the same row gets other bits in a small launch than in a large one."""
    if hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "fused_add_rms_norm"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()")

    def impl(x, residual, weight, eps):
        n, h = x.numel() // x.shape[-1], x.shape[-1]
        z = (x.float() + residual.float()).to(x.dtype)
        residual.copy_(z)
        zf = z.reshape(n, h).float()
        block = 1024 if n < 256 else 256
        parts = torch.stack([(zf[:, s::block] ** 2).sum(dim=1) for s in range(min(block, h))], dim=1)
        if block == 1024:
            parts = parts.to(torch.bfloat16).float()
        var = parts.sum(dim=1, keepdim=True)
        y = zf * torch.rsqrt(var / h + eps)
        x.copy_((y.to(x.dtype) * (weight if weight is not None else 1)).view(x.shape))

    lib.impl("fused_add_rms_norm", impl, "CPU")
    _define_block_dependent_rmsnorm.lib = lib  # keep the registration alive


def _block_sum(parts: torch.Tensor) -> torch.Tensor:
    """cub's block reduction as vLLM's kernels use it: each warp of 32 threads folds its lanes (shuffle-down by 16,
    8, 4, 2, 1), then the warps' totals are folded the same way. The grouping follows the thread count."""
    def warp_fold(v):  # [rows, groups, 32] -> [rows, groups]
        for off in (16, 8, 4, 2, 1):
            v = v.clone()
            v[..., :off] = v[..., :off] + v[..., off:2 * off]
        return v[..., 0]

    n, threads = parts.shape
    warps = warp_fold(torch.nn.functional.pad(parts, (0, -threads % 32)).view(n, -1, 32))
    return warp_fold(torch.nn.functional.pad(warps, (0, 32 - warps.shape[1])).view(n, 1, 32))[:, 0]


def _define_row_count_dependent_rms_norm():
    """A CPU stand-in for vLLM 0.26's `_C.rms_norm`: threads per row = min(hidden / vec, 1024 below 256 rows
    else 256) with vec = 16 bytes of elements; thread t sums the squares of vectors t, t + threads, ... in float32,
    then the block reduction adds the per-thread partials. The reduction order follows the launch's row count."""
    if hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "rms_norm"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("rms_norm(Tensor(a!) out, Tensor input, Tensor? weight, float epsilon) -> ()")

    def impl(out, x, weight, eps):
        h = x.shape[-1]
        n = x.numel() // h
        vec = 16 // x.element_size()
        threads = min(h // vec, 1024 if n < 256 else 256)
        sq = x.reshape(n, h // vec, vec).float() ** 2
        vsum = sq[:, :, 0]
        for j in range(1, vec):
            vsum = vsum + sq[:, :, j]
        parts = torch.zeros(n, threads)
        for s in range(0, h // vec, threads):
            chunk = vsum[:, s:s + threads]
            parts[:, :chunk.shape[1]] += chunk
        y = x.reshape(n, h).float() * torch.rsqrt(_block_sum(parts)[:, None] / h + eps)
        out.copy_((y.to(x.dtype) * (weight if weight is not None else 1)).view(out.shape))

    lib.impl("rms_norm", impl, "CPU")
    _define_row_count_dependent_rms_norm.lib = lib  # keep the registration alive


def test_registry_metadata_is_complete():
    reg = {n: p for n, p in patches.registry().items() if p.target == "vllm"}  # tests/test_megatron_patches.py: the rest
    assert set(reg) == {"fa3-fixed-tile", "fp8-gemm-one-kernel", "gemm-fixed-m", "gemm-fixed-order",
                        "layernorm-float32-rows", "mamba-decode-replay", "mamba-gated-norm-triton",
                        "mamba-ssd-fixed-config", "moe-fixed-config",
                        "moe-slot-order-sum", "rmsnorm-fixed-block", "rmsnorm-rows", "mamba1-prefill-steps"}
    for name, p in reg.items():
        assert p.target == "vllm" and p.gate in {f"C{i}" for i in range(11)}
        assert p.symptom and p.fix and p.cost
        guide = REPO / p.guide
        assert guide.is_file() and name in guide.read_text(), f"{p.guide} must name {name}"
        assert name in (REPO / "guides" / "vllm.md").read_text()


def test_unknown_patch_and_bad_target_are_input_errors(tmp_path):
    with pytest.raises(TicInputError, match="unknown patch 'nope'"):
        patches.parse_names("fa3-fixed-tile,nope")
    from tic.config.schema import parse_config

    with pytest.raises(TicInputError, match="unknown patch"):
        parse_config({"rollout": {"engine": "vllm", "patches": ["nope"]}}, tmp_path)
    with pytest.raises(TicInputError, match="not engine 'hf'"):
        parse_config({"rollout": {"engine": "hf", "patches": ["fa3-fixed-tile"]}}, tmp_path)
    cfg = parse_config({"rollout": {"engine": "vllm", "patches": ["fa3-fixed-tile"]}}, tmp_path)
    assert cfg.rollout.patches == ["fa3-fixed-tile"]


def test_refuses_a_target_version_it_was_not_checked_against(tmp_path, monkeypatch):
    root = make_fake_vllm(tmp_path / "old", "0.25.1")
    monkeypatch.syspath_prepend(str(root))
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    with pytest.raises(TicInputError, match="installed vllm 0.25.1 is outside >=0.26.0,<0.27"):
        patches.apply(["fa3-fixed-tile"])
    import vllm.v1.attention.backends.flash_attn as fa

    assert fa.flash_attn_varlen_func(max_seqlen_q=1) == {"max_seqlen_q": 1}  # nothing was changed
    assert patches.active() == []
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[m]


def test_apply_revert_and_active_read_from_the_patched_objects(fake_vllm):
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.utils as utils

    original = utils.dispatch_unquantized_gemm
    assert patches.apply(ALL) == ALL and sorted(patches.active()) == ALL
    assert patches.apply(ALL) == ALL  # idempotent
    assert linear.dispatch_unquantized_gemm is utils.dispatch_unquantized_gemm is not original
    patches.apply(["fa3-fixed-tile"])
    assert patches.active() == ["fa3-fixed-tile"]
    assert linear.dispatch_unquantized_gemm is original and utils.dispatch_unquantized_gemm is original
    patches.apply([])
    assert patches.active() == []
    from tic.skill.records import environment_fingerprint

    patches.apply(["gemm-fixed-m"])
    assert environment_fingerprint()["patches"] == ["gemm-fixed-m"]


def test_mamba_ssd_fixed_config_leaves_each_autotuner_its_first_config(fake_vllm):
    from tic.patches.vllm.mamba_ssd_fixed_config import KERNELS

    tuners = [getattr(__import__(home, fromlist=[attr]), attr) for home, attr in KERNELS]
    for t in tuners:
        t.cache["tuned"] = t.configs[-1]  # what a process had timed before the patch
    lists = [list(t.configs) for t in tuners]
    patches.apply(["mamba-ssd-fixed-config"])
    patches.apply(["mamba-ssd-fixed-config"])  # idempotent
    assert [t.configs for t in tuners] == [c[:1] for c in lists] and not any(t.cache for t in tuners)
    patches.apply([])
    assert [t.configs for t in tuners] == lists


def test_fa3_fixed_tile_pins_every_launch(fake_vllm):
    import vllm.v1.attention.backends.flash_attn as fa

    assert fa.flash_attn_varlen_func(max_seqlen_q=1, scheduler_metadata="plan", num_splits=0)["max_seqlen_q"] == 1
    patches.apply(["fa3-fixed-tile"])
    for q in (1, 5, 127, 128, 400):
        kw = fa.flash_attn_varlen_func(max_seqlen_q=q, scheduler_metadata="plan", num_splits=0)
        # the step's plan goes with a launch only where the pin left it as the builder planned it
        assert kw == {"max_seqlen_q": max(q, 128), "scheduler_metadata": "plan" if q >= 128 else None,
                      "num_splits": 1}
    assert fa.use_cascade_attention(10, None) is False


def test_fa3_fixed_tile_plans_one_split_and_keeps_the_plan_for_a_natural_launch(fake_vllm, monkeypatch):
    import vllm.v1.attention.backends.flash_attn as fa
    from tic.patches.vllm import fa3_fixed_tile

    assert fa.get_scheduler_metadata(batch_size=4, num_splits=0)["num_splits"] == 0
    patches.apply(["fa3-fixed-tile"])
    assert fa.get_scheduler_metadata(batch_size=4, num_splits=0) == {"batch_size": 4, "num_splits": 1}
    natural = {"agrees": True}
    monkeypatch.setattr(fa3_fixed_tile, "natural_launch_agrees", lambda fn, kw: natural["agrees"])
    assert fa.flash_attn_varlen_func(max_seqlen_q=1, scheduler_metadata="plan", num_splits=0) == \
        {"max_seqlen_q": 1, "scheduler_metadata": "plan", "num_splits": 1}
    natural["agrees"] = False
    assert fa.flash_attn_varlen_func(max_seqlen_q=1, scheduler_metadata="plan", num_splits=0) == \
        {"max_seqlen_q": 128, "scheduler_metadata": None, "num_splits": 1}
    # a windowed call split into rows of their own is another launch than the one planned
    natural["agrees"] = True
    kw = fa.flash_attn_varlen_func(q=torch.zeros(3, 1, 4), cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                                   seqused_k=torch.tensor([5], dtype=torch.int32),
                                   block_table=torch.zeros(1, 2, dtype=torch.int32), window_size=[2, 0],
                                   max_seqlen_q=3, scheduler_metadata="plan", num_splits=0)
    assert kw["scheduler_metadata"] is None and kw["cu_seqlens_q"].tolist() == [0, 1, 2, 3]
    patches.apply([])
    assert fa.get_scheduler_metadata(batch_size=4, num_splits=0)["num_splits"] == 0


def _paged_rows(q, k, v, cu_seqlens_q, seqused_k, block_table, window_size=None):
    """Exact varlen attention over a paged cache (float64, each row its own softmax, KV heads repeated for grouped
    queries), with the row's query count in its sequence beside each row: [rows, heads, dim], [rows]."""
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float64)
    rows_in_call = torch.zeros(q.shape[0], dtype=torch.long)
    group = q.shape[1] // k.shape[2]
    assert k.shape[1] * block_table.shape[1] >= int(seqused_k.max())
    for b in range(cu_seqlens_q.numel() - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        keys = torch.cat([k[p] for p in block_table[b]]).double().repeat_interleave(group, dim=1)
        vals = torch.cat([v[p] for p in block_table[b]]).double().repeat_interleave(group, dim=1)
        for j in range(lo, hi):
            pos = int(seqused_k[b]) - (hi - j)
            start = max(0, pos - int(window_size[0])) if window_size is not None and window_size[0] >= 0 else 0
            s = torch.einsum("hd,khd->hk", q[j].double(), keys[start:pos + 1])
            out[j] = torch.einsum("hk,khd->hd", s.softmax(-1), vals[start:pos + 1])
            rows_in_call[j] = hi - lo
    return out, rows_in_call


def _paged_window_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, window_size=None, max_seqlen_q=None,
                            **_):
    """_paged_rows with a planted tile dependence: a row's value moves with how many query rows its sequence has
    in the call, as FA3's windowed tile does."""
    out, rows = _paged_rows(q, k, v, cu_seqlens_q, seqused_k, block_table, window_size)
    return out + 1e-3 * (rows - 1)[:, None, None]


def test_fa3_fixed_tile_runs_each_windowed_row_as_decode_does(fake_vllm, monkeypatch):
    import vllm.v1.attention.backends.flash_attn as fa

    monkeypatch.setattr(fa, "flash_attn_varlen_func", _paged_window_attention)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    table = torch.tensor([[0, 2, 4], [5, 1, 3]], dtype=torch.int32)
    used = torch.tensor([11, 6], dtype=torch.int32)  # 11 and 6 keys; the last 4 and 3 are this call's queries
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 8, generator=g)

    def prefill(window):
        return fa.flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, max_seqlen_q=4, seqused_k=used,
                                         block_table=table, window_size=window)

    def decode_rows(window):
        rows = []
        for b, (lo, hi) in enumerate(((0, 4), (4, 7))):
            for j in range(lo, hi):
                rows.append(fa.flash_attn_varlen_func(
                    q=q[j:j + 1], k=k, v=v, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
                    seqused_k=used[b:b + 1] - (hi - 1 - j), block_table=table[b:b + 1], window_size=window))
        return torch.cat(rows)

    assert not torch.equal(prefill([3, 0]), decode_rows([3, 0]))  # the planted tile dependence
    patches.apply(["fa3-fixed-tile"])
    assert torch.equal(prefill([3, 0]), decode_rows([3, 0]))
    # the same attention as the call it replaces: every row's keys and window kept (the plant's term is 0 there)
    want = torch.cat([_paged_window_attention(q[j:j + 1], k, v, torch.tensor([0, 1]), used[b:b + 1] - (hi - 1 - j),
                                              table[b:b + 1], [3, 0])
                      for b, (lo, hi) in enumerate(((0, 4), (4, 7))) for j in range(lo, hi)])
    assert torch.equal(prefill([3, 0]), want)
    # full attention keeps one call for the whole prefill (the plant shows: rows are not split apart)
    assert not torch.equal(prefill(None), decode_rows(None))
    assert not torch.equal(prefill([-1, -1]), decode_rows([-1, -1]))


def _paged_causal_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, causal=True, out=None,
                            calls=None, **_):
    """_paged_rows, causal, with a planted tile dependence for head_dim 64 only: rows launched with max_seqlen_q
    below 128 move with it, as FA3's decode tile does at that head size."""
    if calls is not None:
        calls.append(int(max_seqlen_q))
    res, _ = _paged_rows(q, k, v, cu_seqlens_q, seqused_k, block_table)
    if q.shape[-1] == 64 and max_seqlen_q < 128:
        res = res + 0.05 * max_seqlen_q
    return res.to(q.dtype)


@pytest.mark.parametrize("head_dim, pinned", [(64, True), (32, False)])
def test_fa3_fixed_tile_keeps_the_launch_where_a_check_shows_it_gives_the_pinned_bits(fake_vllm, monkeypatch,
                                                                                     head_dim, pinned):
    """A decode row equals the prefill's with the patch either way; the call keeps its own max_seqlen_q only where
    the seeded check found every launch below the pin equal to the pinned one (the planted head_dim 64 is not).
    Checked once per attention shape; FP8-scaled calls and unchecked shapes during a capture are pinned."""
    import functools

    import vllm.v1.attention.backends.flash_attn as fa
    from tic.patches.vllm import fa3_fixed_tile

    calls = []
    monkeypatch.setattr(fa, "flash_attn_varlen_func", functools.partial(_paged_causal_attention, calls=calls))
    monkeypatch.setattr(fa3_fixed_tile, "CHECK_TOKENS", 21)
    monkeypatch.setattr(fa3_fixed_tile, "_natural_ok", {})
    g = torch.Generator().manual_seed(0)
    k = torch.randn(8, 4, 2, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(8, 4, 2, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(9, 4, head_dim, generator=g).to(torch.bfloat16)
    table = torch.tensor([[3, 1, 6]], dtype=torch.int32)

    def attend(rows, used, max_q, **extra):
        cu = torch.tensor([0, rows.shape[0]], dtype=torch.int32)
        return fa.flash_attn_varlen_func(q=rows, k=k, v=v, cu_seqlens_q=cu, max_seqlen_q=max_q,
                                         seqused_k=torch.tensor([used], dtype=torch.int32), max_seqlen_k=12,
                                         block_table=table, causal=True, softcap=0.0, **extra)

    stock = attend(q, 12, 9), attend(q[-1:], 12, 1)
    assert torch.equal(stock[0][-1:], stock[1]) == (head_dim != 64)  # the plant, without the patch
    patches.apply(["fa3-fixed-tile"])
    calls.clear()
    prefill = attend(q, 12, 9)
    checked = len(calls) - 1  # the check's launches ran before this call's own
    # the pinned launch, then each row count below the pin until one differs
    assert checked == (2 if pinned else 1 + len(fa3_fixed_tile.CHECK_QUERY_ROWS))
    assert calls[-1] == (128 if pinned else 9)
    assert torch.equal(attend(q[-1:], 12, 1), prefill[-1:])
    assert calls[-1] == (128 if pinned else 1) and len(calls) == checked + 2  # no second check
    assert patches.registry()["fa3-fixed-tile"].choices() == {"natural_launch_shapes": int(not pinned),
                                                              "pinned_shapes": int(pinned)}
    monkeypatch.setattr(fa3_fixed_tile, "_natural_ok", {})
    calls.clear()
    # vLLM's backend passes the K and V descales (ones) with a 16-bit cache too: the call is checked all the same
    ones = {d: torch.ones(1, 2) for d in fa3_fixed_tile.DESCALES[1:]}
    attend(q[-1:], 12, 1, **ones)
    assert len(calls) == (3 if pinned else 2 + len(fa3_fixed_tile.CHECK_QUERY_ROWS))
    assert calls[-1] == (128 if pinned else 1)
    e4m3 = torch.float8_e4m3fn
    n = len(calls)
    fa.flash_attn_varlen_func(q=q[-1:].to(e4m3), k=k.to(e4m3), v=v.to(e4m3), max_seqlen_q=1,
                              cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_k=12,
                              seqused_k=torch.tensor([12], dtype=torch.int32), block_table=table, causal=True,
                              softcap=0.0, **ones)
    assert calls[n:] == [128]  # FP8 inputs without their query descale: not checkable, pinned
    monkeypatch.setattr(fa3_fixed_tile, "_natural_ok", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    n = len(calls)
    attend(q[-1:], 12, 1)
    assert calls[n:] == [128]  # during a capture: pinned, nothing launched to check


def test_fa3_fixed_tile_checks_an_fp8_call_with_its_scales_spread_over_the_checks_sequences(fake_vllm, monkeypatch):
    import vllm.v1.attention.backends.flash_attn as fa
    from tic.patches.vllm import fa3_fixed_tile

    seen = []

    def attention(**kw):
        seen.append((int(kw["max_seqlen_q"]), tuple(kw["k_descale"].shape), kw["cu_seqlens_q"].numel() - 1))
        return _paged_causal_attention(**kw)

    monkeypatch.setattr(fa, "flash_attn_varlen_func", attention)
    monkeypatch.setattr(fa3_fixed_tile, "CHECK_TOKENS", 21)
    monkeypatch.setattr(fa3_fixed_tile, "_natural_ok", {})
    g = torch.Generator().manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    k, v = (torch.randn(8, 4, 2, 32, generator=g).to(e4m3) for _ in range(2))
    q = torch.randn(1, 4, 32, generator=g).to(e4m3)
    scales = {d: torch.full((1, 2), 0.5) for d in fa3_fixed_tile.DESCALES}
    patches.apply(["fa3-fixed-tile"])
    fa.flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1,
                              seqused_k=torch.tensor([12], dtype=torch.int32), max_seqlen_k=12,
                              block_table=torch.tensor([[3, 1, 6]], dtype=torch.int32), causal=True, **scales)
    assert seen[-1] == (1, (1, 2), 1)  # the call kept its own launch
    checks = seen[:-1]
    assert [c[0] for c in checks] == [128, *fa3_fixed_tile.CHECK_QUERY_ROWS]
    assert all(shape == (seqs, 2) for _, shape, seqs in checks)  # a scale per (sequence, KV head) of each check


def test_gemm_fixed_m_gives_every_row_the_same_gemm_whatever_the_batch(fake_vllm):
    from vllm.model_executor.layers import utils

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g)
    w = torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g)
    stock = utils.dispatch_unquantized_gemm()
    assert not torch.equal(stock(None, x[:5].clone(), w, b), stock(None, x, w, b)[:5])  # the planted flaw
    patches.apply(["gemm-fixed-m"])
    gemm = utils.dispatch_unquantized_gemm()
    full = gemm(None, x, w, b)
    for lo, hi in ((0, 1), (3, 50), (127, 129), (250, 300)):
        assert torch.equal(gemm(None, x[lo:hi].clone(), w, b), full[lo:hi])
    assert torch.equal(gemm(None, x.view(3, 100, 96), w, b).reshape(300, 40), full)
    # without a bias: this GEMM is not mm on a full tile (its split-K), so every tile still goes through it
    plain = gemm(None, x, w)
    assert torch.equal(plain[:128], stock(None, x[:128].clone(), w))
    for lo, hi in ((0, 1), (3, 50), (127, 129), (250, 300)):
        assert torch.equal(gemm(None, x[lo:hi].clone(), w), plain[lo:hi])


def test_patches_that_replace_the_same_function_are_refused_together(fake_vllm, tmp_path):
    from tic.config.schema import load_config
    from tic.core.errors import TicInputError

    with pytest.raises(TicInputError, match="replace the same vLLM function"):
        patches.parse_names("gemm-fixed-m gemm-fixed-order")
    with pytest.raises(TicInputError, match="replace the same vLLM function"):
        patches.apply(["gemm-fixed-order", "gemm-fixed-m"])
    assert patches.active() == []  # refused before anything changed
    cfg = tmp_path / "tic.yaml"
    cfg.write_text("rollout: {engine: vllm, patches: [gemm-fixed-m, gemm-fixed-order]}\n")
    with pytest.raises(Exception, match="replace the same vLLM function"):
        load_config(cfg)


def test_gemm_fixed_order_hands_vllm_tics_gemm_eager_and_as_a_custom_op(fake_vllm, monkeypatch):
    from vllm.model_executor.layers import utils
    from tic.patches.vllm import fixed_order_gemm

    seen = []

    def rowwise(x, weight, bias=None):  # stands for the Triton GEMM on CPU: one row at a time
        seen.append(x.shape[0])
        y = torch.stack([r @ weight.t() for r in x.reshape(-1, x.shape[-1])]).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    monkeypatch.setattr(fixed_order_gemm, "linear", rowwise)
    stock = utils.dispatch_unquantized_gemm()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 24, generator=g).bfloat16(), torch.randn(8, 24, generator=g).bfloat16()
    patches.apply(["gemm-fixed-order"])
    gemm = utils.dispatch_unquantized_gemm()
    assert gemm.__name__ == "tic_gemm" and torch.equal(gemm(None, x, w), rowwise(x, w))
    assert torch.equal(torch.ops.tic.linear_fixed_order(x, w, None), rowwise(x, w))
    assert seen[0] == 37
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):  # what tic's operator recorder sees: one GEMM operator, whatever the tile
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names():
        assert torch.equal(gemm(None, x, w), rowwise(x, w))
    assert Names.ops[0] == "tic.linear_fixed_order.default", Names.ops
    n = len(seen)  # float32 (a TF32 dot in the Triton GEMM) runs vLLM's own GEMM instead
    x32, w32 = x.float(), w.float()
    assert torch.equal(gemm(None, x32, w32), stock(None, x32, w32)) and len(seen) == n
    patches.apply([])
    assert utils.dispatch_unquantized_gemm().__name__ == "default_unquantized_gemm"


def test_fixed_order_gemm_takes_the_fastest_tile_with_the_reference_bits(monkeypatch):
    """The tile choice: a candidate whose bits differ from the reference tile's is never taken, whatever its
    speed; the fastest equal one is, once per size class and weight shape; during a CUDA graph capture an
    unmeasured class runs the reference tile."""
    import sys
    import types

    from tic.patches.vllm import fixed_order_gemm as fog

    fast_wrong, slow, fast = fog.Tile(16, 32, 128, 4, 4), fog.Tile(16, 64, 128, 4, 4), fog.Tile(16, 128, 128, 4, 4)
    speed = {fast_wrong: 1.0, slow: 3.0, fast: 2.0, fog.REFERENCE: 9.0}
    current = []

    def run(x2, weight, bias, tile):
        current.append(tile)
        y = x2 @ weight.t()
        return y + 1e-3 if tile == fast_wrong else y

    testing = types.SimpleNamespace(do_bench=lambda fn, **kw: (fn(), speed[current[-1]])[1])
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(testing=testing))
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    monkeypatch.setattr(fog, "run", run)
    monkeypatch.setattr(fog, "_chosen", {})
    monkeypatch.setattr(fog, "CANDIDATES", ((16, (fast_wrong, slow, fast)), (1 << 62, (slow,))))
    w = torch.randn(8, 24)
    assert fog.tile_for(5, w, torch.float32, False) == fast
    n = len(current)
    assert fog.tile_for(16, w, torch.float32, False) == fast and len(current) == n  # measured once per class
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fog.tile_for(100, w, torch.float32, False) == fog.REFERENCE


def test_fixed_order_gemm_runs_cublas_only_where_it_gave_the_reference_bits(monkeypatch):
    """cuBLAS serves a problem once a check on seeded rows of that exact problem matched the reference tile; a
    planted cuBLAS that sums in another order for few rows (as its split-K kernels do) is never used there, so every
    row equals the reference tile's. Checked once per problem and alignment; never during a capture, nor for a
    strided operand."""
    from tic.patches.vllm import fixed_order_gemm as fog

    reference = lambda x2, w, b, tile: x2 @ w.t()  # noqa: E731
    checks, served, checking = [], [], []

    def planted_cublas(x2, w, b):
        if not checking:
            served.append(x2.shape[0])
        y = x2 @ w.t()
        return y + 1e-3 if x2.shape[0] < 4 else y  # another order below 4 rows

    def check(*a):
        checks.append(a[0])
        checking.append(1)
        try:
            return real_check(*a)
        finally:
            checking.pop()

    real_check = fog._cublas_check
    monkeypatch.setattr(fog, "run", reference)
    monkeypatch.setattr(fog, "tile_for", lambda *a: fog.REFERENCE)
    monkeypatch.setattr(fog, "_cublas", planted_cublas)
    monkeypatch.setattr(fog, "_cublas_check", check)
    monkeypatch.setattr(fog, "_cublas_ok", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 32, generator=g), torch.randn(9, 32, generator=g)
    for m in (1, 3, 4, 9, 4):
        served.clear()
        assert torch.equal(fog.linear(x[:m], w), x[:m] @ w.t())
        assert served == ([m] if m >= 4 else [])  # cuBLAS ran the real rows from 4 rows on
    assert checks == [1, 3, 4, 9]  # once per problem
    shifted = torch.randn(1 + 4 * 32, generator=g)[1:].view(4, 32)  # 4 rows at a 4-byte alignment
    assert fog._alignment(shifted) == 4 != fog._alignment(x)
    assert torch.equal(fog.linear(shifted, w), shifted @ w.t())
    assert checks[-1] == 4 and len(checks) == 5  # another alignment: checked again
    # what the records report (environment.patch_choices): three problems on cuBLAS, two on tic's kernel
    assert fog.checks() == {"cublas_problems": 3, "fixed_order_kernel_problems": 2}
    assert patches.registry()["gemm-fixed-order"].choices() == fog.checks()
    served.clear()
    strided = x.t().contiguous().t()[:4]  # compared with the reference on the same operand: a CPU BLAS may sum a
    assert torch.equal(fog.linear(strided, w), strided @ w.t()) and not served  # strided one in another order
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not fog.cublas_agrees(x[:7], w, None) and len(checks) == 5
    assert not fog.cublas_agrees(x[:7], w, None)
    # a problem a graph met first while it was captured: the graph keeps tic's kernel, and the records say so
    assert fog.checks() == {"cublas_problems": 3, "fixed_order_kernel_problems": 2, "undecided_at_capture": 1}


@pytest.mark.parametrize("configured", [0, 2])
def test_decision_patches_run_each_graph_size_eagerly_before_capturing_it(fake_vllm, configured):
    """vLLM's V1 runner captures a graph size without an eager run first (num_warmups 0): a patch's checks would
    meet that graph's problems only while capturing and leave it the fallback. While gemm-fixed-order or
    fa3-fixed-tile is applied each size runs eagerly at least once first (a configured count above one is kept);
    reverting the last of them restores vLLM's runner."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def captured(runner):
        runner.runs.clear()
        runner._warmup_and_capture(8, "FULL")
        runner._warmup_and_capture(4, cudagraph_runtime_mode="PIECEWISE", num_warmups=3)
        return runner.runs

    runner = GPUModelRunner(warmups=configured)
    stock = [(8, "eager")] * configured + [(8, "FULL")] + [(4, "eager")] * 3 + [(4, "PIECEWISE")]
    assert captured(runner) == stock
    patches.apply(["gemm-fixed-order", "fa3-fixed-tile"])
    assert captured(runner) == [(8, "eager")] * max(1, configured) + stock[configured:]
    patches.apply(["fa3-fixed-tile"])  # gemm-fixed-order reverted: the other still needs the eager run
    assert captured(runner)[0] == (8, "eager")
    patches.apply([])
    assert captured(runner) == stock


def test_fixed_order_gemm_checks_cublas_on_every_row_with_the_reference_in_pieces(monkeypatch):
    """The cuBLAS check computes the reference tile's rows a piece at a time (one full-size output held, so a
    prefill step's widest projection fits under the check's cap) and still compares every row: a planted cuBLAS
    off in the last row only is refused, an exact one taken. Past the cap no check runs."""
    from tic.patches.vllm import fixed_order_gemm as fog

    pieces = []
    rowwise = lambda x2, w: torch.stack([row @ w.t() for row in x2])  # noqa: E731  (CPU GEMMs block by rows)

    def reference(x2, w, b, tile):
        pieces.append(x2.shape[0])
        return rowwise(x2, w)

    monkeypatch.setattr(fog, "run", reference)
    monkeypatch.setattr(fog, "CHECK_ROWS", 4)
    w = torch.randn(8, 32)
    exact = lambda x2, w, b: rowwise(x2, w)  # noqa: E731
    last_row_off = lambda x2, w, b: torch.cat([rowwise(x2[:-1], w), rowwise(x2[-1:], w) + 1e-3])  # noqa: E731
    monkeypatch.setattr(fog, "_cublas", exact)
    assert fog._cublas_check(10, w, torch.float32, False, 256) and pieces == [4, 4, 2]
    monkeypatch.setattr(fog, "_cublas", last_row_off)
    assert not fog._cublas_check(10, w, torch.float32, False, 256)
    assert 16384 * 24576 <= fog.CUBLAS_CHECK_ELEMENTS < 16384 * 151936  # gate_up checked, a training lm_head not
    monkeypatch.setattr(fog, "_cublas", exact)  # a check would now say yes
    monkeypatch.setattr(fog, "_cublas_ok", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fog.cublas_agrees(torch.randn(9, 32), w, None)
    monkeypatch.setattr(fog, "CUBLAS_CHECK_ELEMENTS", 9 * 8 - 1)
    assert not fog.cublas_agrees(torch.randn(9, 32), w, None)


def test_gemm_fixed_m_custom_op_runs_where_the_dispatcher_never_ran(fake_vllm):
    """A graph vLLM compiled in an earlier process and loaded from its compile cache calls the custom op without
    tracing the dispatcher (under vLLM's default compile mode this was a KeyError during memory profiling)."""
    from vllm.model_executor.layers import utils
    from tic.patches.vllm import _gemm_dispatch

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(200, 96, generator=g), torch.randn(40, 96, generator=g)
    stock = utils.dispatch_unquantized_gemm()
    patches.apply(["gemm-fixed-m"])
    _gemm_dispatch._vllm.pop("gemm", None)  # no dispatch in this process
    got = torch.ops.tic.linear_fixed_m(x, w, None)
    assert torch.equal(got[:128], stock(None, x[:128].clone(), w))
    assert torch.equal(got[128:], stock(None, torch.cat([x[128:], x.new_zeros(56, 96)]), w)[:72])


def test_gemm_fixed_m_batches_or_writes_full_tiles_in_place_only_where_that_gives_the_gemms_bits(fake_vllm,
                                                                                                 monkeypatch):
    from tic.patches.vllm import _gemm_dispatch
    from tic.patches.vllm import gemm_fixed_m as gm

    patches.apply(["gemm-fixed-m"])
    monkeypatch.setattr(gm, "_state", dict(gm._state))  # this test's GEMMs and probes stay here
    monkeypatch.setattr(_gemm_dispatch, "_vllm", dict(_gemm_dispatch._vllm))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 96, generator=g), torch.randn(40, 96, generator=g)
    calls = []

    def counting(name, fn):
        return lambda *a, **kw: calls.append((name, a[0].shape[0])) or fn(*a, **kw)

    def mm_gemm(layer, t, weight, bias=None):  # a GEMM that is mm(x, w.t()): full tiles may skip it
        return t @ weight.t() if bias is None else t @ weight.t() + bias

    def wide_gemm(layer, t, weight, bias=None):  # one that is not: accumulates in float64, rounds once
        return (t.double() @ weight.double().t()).to(t.dtype)

    real_mm, real_bmm = torch.mm, torch.bmm

    def lying_bmm(a, b, out):  # a batched GEMM whose bits differ from the per-tile GEMM's: never used
        return out.copy_(real_bmm(a.double(), b.double()))

    cases = [(mm_gemm, real_bmm, [("bmm", 2)]), (mm_gemm, lying_bmm, [("mm", 128), ("mm", 128)]),
             (wide_gemm, real_bmm, [])]
    for gemm, bmm, expect in cases:
        _gemm_dispatch._vllm["gemm"] = gemm
        gm._state.update(same_bits={})
        monkeypatch.setattr(torch, "mm", counting("mm", real_mm))
        monkeypatch.setattr(torch, "bmm", counting("bmm", bmm))
        out = gm.linear_fixed_m(x, w)  # probes first (they call mm/bmm too), then runs
        calls.clear()
        out = gm.linear_fixed_m(x, w)
        assert calls == expect, (gemm.__name__, bmm)
        tiles = [gemm(None, torch.cat([x[s:s + 128], x.new_zeros(max(0, s + 128 - 300), 96)]), w)[:min(128, 300 - s)]
                 for s in (0, 128, 256)]
        assert torch.equal(out, torch.cat(tiles))  # whichever path, each tile's rows are the GEMM's own bits
        one = gm.linear_fixed_m(x[:128].clone(), w)  # one full tile: never batched
        assert torch.equal(one, out[:128])


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages that tensors made under this mode keep alive (each storage counted once)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _drop(self, key):
        self.live[key][1] -= 1
        if not self.live[key][1]:
            self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live[key] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[key][0]
                    self.peak = max(self.peak, self.now)
                self.live[key][1] += 1
                weakref.finalize(t, self._drop, key)
        return out


def test_gemm_fixed_m_probe_holds_one_weight_and_one_output_at_a_time(fake_vllm, monkeypatch):
    """The probe runs once per problem inside a forward (rollout or training), on top of its activations: for an
    lm_head it must not hold the tiles' outputs twice more (a list and its concatenation) nor a second weight."""
    from tic.patches.vllm import gemm_fixed_m as gm

    patches.apply(["gemm-fixed-m"])
    monkeypatch.setattr(gm, "_state", dict(gm._state, same_bits={}))
    x, w = torch.randn(4 * gm.ROWS, 16), torch.randn(2048, 16)  # the weight and each output: 128 KiB, 4 MiB
    with _PeakBytes() as mem:
        assert gm._same_bits("batched", lambda layer, t, weight, b: t @ weight.t(), x, w, 4)
    probe = 4 * gm.ROWS * (16 + 2048) * 4 + w.nbytes  # operands and the batched output
    assert mem.peak <= probe + gm.ROWS * 2048 * 4 * 2, mem.peak  # plus a tile's GEMM (and its transient)

def test_rmsnorm_fixed_block_removes_the_block_shape_dependence(fake_vllm):
    _define_block_dependent_rmsnorm()
    import vllm._custom_ops as ops
    from vllm import ir
    import vllm.kernels.vllm_c  # noqa: F401

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 2048, generator=g) * torch.logspace(-3, 3, 2048)).to(torch.bfloat16)
    r = torch.randn(300, 2048, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, generator=g).to(torch.bfloat16)

    def run(fn, rows):
        a, b = x[:rows].clone(), r[:rows].clone()
        fn(a, b, w, 1e-6)
        return a[:8], b[:8]

    stock_small, stock_large = run(ops.fused_add_rms_norm, 8), run(ops.fused_add_rms_norm, 300)
    assert not torch.equal(stock_small[0], stock_large[0])  # the planted flaw shows without the patch
    patches.apply(["rmsnorm-fixed-block"])
    for entry in (ops.fused_add_rms_norm, ir.ops.fused_add_rms_norm.impls["vllm_c"].impl_fn):
        small, large = run(entry, 8), run(entry, 300)
        assert torch.equal(small[0], large[0]) and torch.equal(small[1], large[1])
        assert torch.equal(large[0], stock_large[0])  # same values as the kernel's large-batch launch


def test_rmsnorm_fixed_block_padding_rows_never_reach_the_real_ones(fake_vllm, monkeypatch):
    """The padded launch leaves its padding rows unwritten (no fill per launch): whatever they hold, NaN included,
    the real rows get the large launch's bits."""
    _define_block_dependent_rmsnorm()
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 2048, generator=g).to(torch.bfloat16)
    r = torch.randn(300, 2048, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, generator=g).to(torch.bfloat16)
    patches.apply(["rmsnorm-fixed-block"])
    large_x, large_r = x.clone(), r.clone()
    ops.fused_add_rms_norm(large_x, large_r, w, 1e-6)
    real_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real_empty(t, *a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch.Tensor, "new_zeros", lambda *a, **k: pytest.fail("a padded launch filled its buffer"))
    small_x, small_r = x[:8].clone(), r[:8].clone()
    ops.fused_add_rms_norm(small_x, small_r, w, 1e-6)
    assert torch.equal(small_x, large_x[:8]) and torch.equal(small_r, large_r[:8])


def _run(args, env_extra, fake_root):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_root), os.environ.get("PYTHONPATH", "")]),
           **env_extra}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_plugin_entry_point_applies_tic_patches_in_a_fresh_process(tmp_path):
    from importlib.metadata import entry_points

    if not any(ep.value == "tic.patches.plugin:load" for ep in entry_points(group="vllm.general_plugins")):
        pytest.skip("tic is not installed as a distribution (pip install -e .): no entry point to load")
    root = make_fake_vllm(tmp_path / "site")
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from tic import patches; print(sorted(patches.active()))")
    p = _run(["-c", code], {"TIC_PATCHES": "fa3-fixed-tile,gemm-fixed-m"}, root)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['fa3-fixed-tile', 'gemm-fixed-m']"
    ok = _run(["-m", "tic.skill.cli", "patch", "status"], {"TIC_PATCHES": "gemm-fixed-m"}, root)
    assert ok.returncode == 0, ok.stderr
    assert "gemm-fixed-m" in ok.stdout and "active" in ok.stdout
    old = make_fake_vllm(tmp_path / "old", "0.27.0")
    bad = _run(["-m", "tic.skill.cli", "patch", "status"], {"TIC_PATCHES": "gemm-fixed-m"}, old)
    assert bad.returncode == 2 and "outside >=0.26.0,<0.27" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_rmsnorm_fixed_block_gives_plain_rms_norm_one_launch_shape_for_every_row_count(fake_vllm):
    _define_row_count_dependent_rms_norm()
    import vllm._custom_ops as ops
    from vllm import ir
    import vllm.kernels.vllm_c  # noqa: F401

    g = torch.Generator().manual_seed(0)
    # float32 rows (4 per 16-byte vector): 1024 threads below 256 rows, 256 from 256 rows on. In bf16 the output's
    # rounding hides most last-bit changes of the sum, so few rows of a small test would show them
    h = 4096
    x = torch.randn(300, h, generator=g)
    w = torch.randn(h, generator=g)

    def run(fn, rows):
        out = torch.empty(rows, h, dtype=x.dtype)
        fn(out, x[:rows].clone(), w, 1e-6)
        return out[:8]

    def run_ir(rows):
        return ir.ops.rms_norm.impls["vllm_c"].impl_fn(x[:rows].clone(), w, 1e-6)[:8]

    stock_small, stock_large = run(ops.rms_norm, 8), run(ops.rms_norm, 300)
    assert not torch.equal(stock_small, stock_large)  # the launcher's row-count dependence shows without the patch
    patches.apply(["rmsnorm-fixed-block"])
    assert patches.registry()["rmsnorm-fixed-block"].is_applied()
    for small, large in ((run(ops.rms_norm, 8), run(ops.rms_norm, 300)), (run_ir(8), run_ir(300))):
        assert torch.equal(small, large)
        assert torch.equal(large, stock_large)  # the values of the kernel's own large-batch launch
    # a strided per-head view (q/k norm on a slice of the fused qkv output) keeps its values too
    qkv = torch.randn(3, 2 * 16 * 128, generator=g)
    q = qkv[:, : 16 * 128].view(3, 16, 128)
    got = ir.ops.rms_norm.impls["vllm_c"].impl_fn(q, w[:128], 1e-6)
    ref = torch.empty(3 * 16, 128, dtype=q.dtype)
    torch.ops._C.rms_norm(ref, q.reshape(-1, 128).contiguous(), w[:128], 1e-6)
    assert got.shape == q.shape and torch.equal(got.reshape(-1, 128), ref)
    patches.apply([])
    assert not patches.registry()["rmsnorm-fixed-block"].is_applied()


def test_rmsnorm_fixed_block_routes_vllms_native_norm_to_the_row_kernel_on_cuda_only(fake_vllm):
    """vLLM runs its native IR norm where the CUDA kernel refuses the arguments (Gemma's float32 (1 + w) weight
    with bf16 rows); the patch routes it to the fixed-order row kernel on CUDA and leaves CPU calls, and the
    unpatched state, to the native code."""
    from vllm import ir

    native = {op: ir.ops.__dict__[op].impls["native"].impl_fn for op in ("rms_norm", "fused_add_rms_norm")}
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g) + 1.0  # float32, as Gemma passes it
    want = native["rms_norm"](x, w, 1e-6), native["fused_add_rms_norm"](x, r, w, 1e-6)
    patches.apply(["rmsnorm-fixed-block"])
    try:
        for op in native:
            impl = ir.ops.__dict__[op].impls["native"].impl_fn
            assert impl is not native[op] and impl.__wrapped__ is native[op]
        assert torch.equal(ir.ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6), want[0])  # CPU: native code
        got = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, r, w, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want[1]))
    finally:
        patches.apply([])
    assert all(ir.ops.__dict__[op].impls["native"].impl_fn is native[op] for op in native)


def test_rmsnorm_rows_sends_every_norm_entry_to_the_row_kernel_unpadded(fake_vllm, monkeypatch):
    """rmsnorm-rows: vLLM's CUDA entries (_custom_ops and the IR's vllm_c), in place or functional, and its native
    code all reach the row kernel with the call's own rows (no padded launch), so a row gets the same bits in a
    small launch as in a large one; the stock kernels (stand-ins whose reduction follows the row count) do not.
    Exclusive with rmsnorm-fixed-block; off the row kernel's device, and reverted, vLLM's code runs."""
    _define_block_dependent_rmsnorm()
    _define_row_count_dependent_rms_norm()
    import vllm._custom_ops as ops
    from vllm import ir
    import vllm.kernels.vllm_c  # noqa: F401

    from tic.patches.vllm import rmsnorm_rows, rowwise_rmsnorm

    rows_seen = []

    def row_kernel(x, weight, epsilon, residual=None):  # a stand-in of the Triton kernel: float64 per row
        z = x.double() + (residual.double() if residual is not None else 0)
        rows_seen.append(z.numel() // z.shape[-1])
        y = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + epsilon)
        y = (y.to(weight.dtype) * weight).to(x.dtype)
        return y if residual is None else (y, z.to(x.dtype))

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 2048, generator=g) * torch.logspace(-3, 3, 2048)).to(torch.bfloat16)
    r = torch.randn(300, 2048, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, generator=g).to(torch.bfloat16)

    def in_place(rows):
        a, b, out = x[:rows].clone(), r[:rows].clone(), torch.empty(rows, 2048, dtype=torch.bfloat16)
        ops.fused_add_rms_norm(a, b, w, 1e-6)
        ops.rms_norm(out, x[:rows].clone(), w, 1e-6)
        return a[:8], b[:8], out[:8]

    def functional(provider, rows):
        impls = ir.ops.rms_norm.impls[provider], ir.ops.fused_add_rms_norm.impls[provider]
        y, res = impls[1].impl_fn(x[:rows].clone(), r[:rows].clone(), w, 1e-6)
        return y[:8], res[:8], impls[0].impl_fn(x[:rows].clone(), w, 1e-6)[:8]

    stock = in_place(8), in_place(300)
    assert not all(torch.equal(a, b) for a, b in zip(*stock))  # the planted row-count dependence shows
    assert patches.conflict(["rmsnorm-rows", "rmsnorm-fixed-block"]) is not None
    monkeypatch.setattr(rowwise_rmsnorm, "rms_norm_rows", row_kernel)
    patches.apply(["rmsnorm-rows"])
    try:
        assert patches.registry()["rmsnorm-rows"].is_applied()
        assert all(torch.equal(a, b) for a, b in zip(in_place(8), stock[0]))  # CPU tensors: vLLM's own code
        monkeypatch.setattr(rmsnorm_rows, "on_row_kernel", lambda t: True)
        want = row_kernel(x[:8], w, 1e-6, r[:8]) + (row_kernel(x[:8], w, 1e-6),)
        for run in (in_place, lambda n: functional("vllm_c", n), lambda n: functional("native", n)):
            rows_seen.clear()
            small, large = run(8), run(300)
            assert rows_seen == [8, 8, 300, 300]  # each call's own rows, never a padded launch
            assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(small, large, want))
    finally:
        patches.apply([])
    assert not patches.registry()["rmsnorm-rows"].is_applied()
    assert all(torch.equal(a, b) for a, b in zip(in_place(8), stock[0]))


def _rows_by_formula(rows) -> torch.Tensor:
    """Every row as the row kernel reads it: row r starts (r // groups) * outer + (r % groups) * inner elements
    after the tensor's first element."""
    t, h = rows.tensor, rows.tensor.shape[-1]
    n = t.numel() // h
    r = torch.arange(n)
    starts = (r // rows.groups) * rows.outer + (r % rows.groups) * rows.inner
    flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))
    return flat[starts[:, None] + torch.arange(h)[None, :]]


def test_row_kernel_reads_strided_rows_in_place_and_copies_only_what_it_cannot_address():
    """The per-head q/k norms of a fused qkv projection are read where they lie (no copy), and so are plain
    row-strided views; a layout the kernel's (rows, groups) addressing cannot reach, or a row start off the
    alignment its launch assumes, is copied. The launch (block, rows per program, warps, alignment) follows the
    row length alone."""
    from tic.patches.vllm.rowwise_rmsnorm import grouped_rows, rms_launch

    launch = rms_launch(128)
    assert rms_launch(128) == launch and launch.align == 16 and launch.rows * launch.block <= 4096
    assert rms_launch(4096).rows == 1 and rms_launch(72).align == 8 and rms_launch(72).block == 128
    qkv = torch.randn(37, 6 * 128 + 2 * 2 * 128).to(torch.bfloat16)
    for t, groups in ((qkv[:, :768].view(37, 6, 128), 6), (qkv[:, 768:1024].view(37, 2, 128), 2),
                      (qkv[:, :128], 1), (qkv[:, 8:8 + 128], 1), (torch.randn(2, 5, 4, 128).to(torch.bfloat16), 1)):
        rows = grouped_rows(t, launch.align)
        assert rows.tensor.data_ptr() == t.data_ptr() and rows.groups == groups  # no copy
        assert torch.equal(_rows_by_formula(rows), t.reshape(-1, 128))
    for t in (torch.randn(128, 9).t(),  # columns as rows
              qkv.view(-1)[1:1 + 37 * 128].view(37, 128),  # a row start off 16 bytes
              torch.randn(37, 1288).to(torch.bfloat16)[:, :128]):  # a row stride off the launch's 16 elements
        rows = grouped_rows(t, launch.align)
        assert rows.tensor.data_ptr() != t.data_ptr() and rows.tensor.is_contiguous() and rows.groups == 1
        assert torch.equal(_rows_by_formula(rows), t.reshape(-1, 128))


def test_row_kernel_launches_one_specialisation_for_every_layout_and_row_count(monkeypatch):
    """What fixes a row's bits on the GPU is the compiled kernel: its compile-time constants, warps and which
    pointers are 16-byte aligned (integers are not specialised). A q/k norm's strided per-head rows (the rollout),
    the same rows contiguous (the training forward), few rows and many, a misaligned copy's source: every launch of
    one row length gets the same specialisation."""
    from tic.patches.vllm import rowwise_rmsnorm as rr

    launches = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **constants):
                pointers = [a for a in args if isinstance(a, torch.Tensor)]
                launches.append((tuple(sorted(constants.items())), tuple(t.data_ptr() % 16 == 0 for t in pointers),
                                 tuple(t.dtype for t in pointers)))
            return launch

    monkeypatch.setattr(rr, "_kernel", lambda: Launcher())
    qkv = torch.randn(300, 12 * 128).to(torch.bfloat16)
    w = torch.randn(128).to(torch.bfloat16)
    q = qkv[:, 4 * 128:].view(300, 8, 128)
    for x in (q, q[:3], q.contiguous(), q.contiguous().view(2, 150, 8, 128), qkv.view(-1)[1:1 + 9 * 128].view(9, 128)):
        rr.rms_norm_rows(x, w, 1e-6)
    assert len(launches) == 5 and len(set(launches)) == 1, launches
    assert all(launches[0][1])  # every pointer aligned
    hidden = torch.randn(64, 4096).to(torch.bfloat16)
    rr.rms_norm_rows(hidden, torch.randn(4096).to(torch.bfloat16), 1e-6, hidden.clone())
    assert launches[-1] != launches[0]  # another row length, another launch


ROW_KERNEL_UNDER_INTERPRETER = """
import torch
from tic.patches.vllm.rowwise_rmsnorm import rms_norm_rows

g = torch.Generator().manual_seed(0)
qkv = torch.randn(37, 12 * 128, generator=g).to(torch.bfloat16)
w = torch.randn(128, generator=g).to(torch.bfloat16)
q = qkv[:, 4 * 128:].view(37, 8, 128)  # a q/k norm's per-head view of a fused projection
whole = rms_norm_rows(q, w, 1e-6)
assert torch.equal(whole, rms_norm_rows(q.contiguous(), w, 1e-6)), "strided rows differ from copied ones"
assert torch.equal(whole, torch.cat([rms_norm_rows(q[s:s + 5], w, 1e-6) for s in range(0, 37, 5)]))
w72 = torch.randn(72, generator=g).to(torch.bfloat16)
k72 = torch.randn(37, 12 * 72, generator=g).to(torch.bfloat16)[:, 8 * 72:].view(37, 4, 72)  # 72 of a block of 128
odd = rms_norm_rows(k72, w72, 1e-6)
assert torch.equal(odd, rms_norm_rows(k72.contiguous(), w72, 1e-6))
x, r = (torch.randn(3, 7, 4096, generator=g) * 4).to(torch.bfloat16), torch.randn(3, 7, 4096, generator=g)
r, w2 = r.to(torch.bfloat16), torch.randn(4096, generator=g).to(torch.bfloat16)
y, res = rms_norm_rows(x, w2, 1e-6, r)
for got, inp, wt in ((whole, q, w), (odd, k72, w72), (y, x.float() + r.float(), w2)):
    z = inp.double()
    want = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)).to(wt.dtype).double() * wt.double()
    # the interpreter rounds float32 to bfloat16 toward zero: a few units in the last place, never more
    assert ((got.double() - want).abs() <= 4 * 2.0 ** (want.abs().log2().floor() - 7)).all(), "values off"
total = x.double() + r.double()
assert ((res.double() - total).abs() <= 2.0 ** (total.abs().log2().floor() - 7)).all()
print("ok")
"""


def test_row_kernel_under_triton_interpreter_addresses_strided_rows_as_copied_ones():
    """The Triton row kernel itself, run by Triton's CPU interpreter in a fresh process (it must be chosen before
    Triton is imported): per-head rows read in place from a fused projection give the same results as the same
    rows copied out and as small launches, and the values (and the fused residual) are the norm's. The interpreter
    checks addressing and masks, not the GPU's bits: norm_launch_probe.py --row-kernel does that on the device."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", ROW_KERNEL_UNDER_INTERPRETER], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def _row_kernel_ptx(h: int, aligned_pointers: bool = True, **options) -> str:
    """The row kernel compiled for an H100 (sm_90) by Triton on this machine, as rms_norm_rows launches it for rows
    of h elements (a residual and a weight), to PTX: no GPU needed."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tic.patches.vllm.rowwise_rmsnorm import _kernel, rms_launch

    kernel, launch = _kernel(), rms_launch(h)
    params = list(inspect.signature(kernel.fn).parameters)
    constant = {p.name for p in kernel.params if p.is_constexpr}  # as the kernel declares them
    values = {p: v for p, v in (("H", h), ("HAS_RESIDUAL", True), ("HAS_WEIGHT", True), ("BLOCK", launch.block),
                                ("ROWS", launch.rows), ("ALIGN", launch.align)) if p in constant}
    signature = {p: "constexpr" if p in values else "*bf16" if p.endswith("_ptr") else "fp32" if p == "eps"
                 else "i32" for p in params}
    # the host hands the kernel 16-byte-aligned pointers only, which Triton sees as their divisibility
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p.endswith("_ptr") and aligned_pointers}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(params.index(p),): v for p, v in values.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": launch.warps, **options}).asm["ptx"]


def test_row_kernel_moves_its_rows_in_16_byte_vectors():
    """On the GPU the row kernel is bound by memory: a load or store of one bfloat16 at a time made it several
    times slower than Inductor's fused norm. Compiled for sm_90 here, every global load and store of the kernel is
    a 16-byte vector, for hidden sizes and per-head lengths alike, 72 (a block of 128) included. The control:
    the same kernel without the pointers' alignment is compiled to narrower accesses, so the check sees them."""
    pytest.importorskip("triton.backends.nvidia")
    import re

    def accesses(ptx: str) -> set[str]:
        return set(re.findall(r"(?:ld|st)\.global(?:\.\w+)*", ptx))

    for h in (4096, 5120, 128, 72):
        assert accesses(_row_kernel_ptx(h)) == {"ld.global.v4.b32", "st.global.v4.b32"}, h
    assert accesses(_row_kernel_ptx(4096, aligned_pointers=False)) - {"ld.global.v4.b32", "st.global.v4.b32"}


def test_tic_triton_kernels_pin_fma_contraction_instead_of_taking_tritons_default():
    """Whether Triton contracts a multiply and an add into one FMA changes a kernel's rounding, and its default
    changes between releases (3.10 turns it off). Compiled for sm_90 here, the row kernel has FMAs with contraction
    on and none with it off, so the option decides its bits; every launch of tic's Triton kernels passes it."""
    pytest.importorskip("triton.backends.nvidia")
    import inspect
    import re

    from tic.patches.vllm import fixed_order_gemm, layernorm_float32_rows, rowwise_rmsnorm
    from tic.patches.vllm._triton_options import PINNED

    fma = {on: len(re.findall(r"\bfma\.rn", _row_kernel_ptx(4096, enable_fp_fusion=on))) for on in (True, False)}
    assert fma[True] > 0 == fma[False], fma
    assert PINNED == {"enable_fp_fusion": True}
    for module in (rowwise_rmsnorm, layernorm_float32_rows, fixed_order_gemm):  # each launch site passes it
        source = inspect.getsource(module)
        sites = len(re.findall(r"_kernel\(\)\[\(", source))
        assert sites > 0 and source.count(", **PINNED)") == sites, module.__name__


def test_fp8_gemm_one_kernel_takes_deepgemm_for_every_row_count(fake_vllm):
    """The dynamic block-FP8 dispatch reads vllm.envs once, for its batch-invariant switch: patched, every row
    count takes the DeepGEMM branch while the other settings stay vLLM's; reverted, small batches go back to
    FlashInfer."""
    import vllm.envs as real
    from vllm.model_executor.kernels.linear.scaled_mm import flashinfer

    assert [flashinfer.dynamic_blockscale_gemm(m) for m in (1, 31, 32, 4096)] == ["flashinfer"] * 2 + ["deepgemm"] * 2
    patches.apply(["fp8-gemm-one-kernel"])
    assert patches.registry()["fp8-gemm-one-kernel"].is_applied()
    assert [flashinfer.dynamic_blockscale_gemm(m) for m in (1, 31, 32, 4096)] == ["deepgemm"] * 4
    assert flashinfer.envs.VLLM_USE_DEEP_GEMM is real.VLLM_USE_DEEP_GEMM and real.VLLM_BATCH_INVARIANT is False
    patches.apply(["fp8-gemm-one-kernel"])  # idempotent
    assert flashinfer.envs.__wrapped__ is real
    patches.apply([])
    assert flashinfer.envs is real and flashinfer.dynamic_blockscale_gemm(1) == "flashinfer"


def test_moe_fixed_config_gives_every_step_the_prefill_sized_config(fake_vllm):
    """vLLM's rule picks the fused-MoE tiles from the step's token count; patched, the caller inside fused_moe and
    a module that imported the rule by name both get the config of a 4096-token step for every M; reverted, the
    small steps get their own tiles again."""
    from vllm.model_executor.layers.fused_moe import fused_moe
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    shapes = ((8, 64, 32), (8, 32, 32), 2, "fp8_w8a8", )
    small, large = (fused_moe.try_get_optimal_moe_config(*shapes, m, block_shape=[128, 128]) for m in (4, 4096))
    assert small["BLOCK_SIZE_M"] == 16 and large["BLOCK_SIZE_M"] == 64
    patches.apply(["moe-fixed-config"])
    assert patches.registry()["moe-fixed-config"].is_applied()
    for m in (1, 4, 64, 65, 100000):
        assert fused_moe.fused_experts_config(*shapes, m, [128, 128]) == large
        assert triton_moe.experts_config(*shapes, m, [128, 128]) == large
    patches.apply(["moe-fixed-config"])  # idempotent: one wrapper
    assert fused_moe.try_get_optimal_moe_config.__wrapped__.__name__ == "try_get_optimal_moe_config"
    assert not hasattr(fused_moe.try_get_optimal_moe_config.__wrapped__, "__wrapped__")
    patches.apply([])
    assert fused_moe.fused_experts_config(*shapes, 4, [128, 128]) == small
    assert triton_moe.experts_config(*shapes, 4, [128, 128]) == small


def test_layernorm_float32_rows_takes_commandrs_norm_on_cuda_only(fake_vllm):
    """The patch replaces commandr.layer_norm_func where vLLM's LayerNorm reads it; a CPU call keeps vLLM's own
    function (its bits), and revert gives the original back. The Triton kernel itself runs on the GPU only."""
    from vllm.model_executor.models import commandr

    original = commandr.layer_norm_func
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    want = original(x, w, 1e-5)
    patches.apply(["layernorm-float32-rows"])
    try:
        assert commandr.layer_norm_func is not original and patches.active() == ["layernorm-float32-rows"]
        got, _ = commandr.LayerNorm(w, 1e-5)(x)
        assert torch.equal(got, want)
    finally:
        patches.apply([])
    assert commandr.layer_norm_func is original


def test_vllm_provider_runs_commandrs_norm_function_whatever_patch_holds_it(fake_vllm, monkeypatch):
    """The training provider's float32 LayerNorm is vLLM's commandr.layer_norm_func as the module holds it when
    called, so a rollout patch of that function reaches the training forward too."""
    from vllm.model_executor.models import commandr

    from tic.harness.kernels.spec import RolloutKernels
    from tic.harness.kernels.vllm_provider import VLLMProvider

    monkeypatch.setattr(VLLMProvider, "_load_vllm", lambda self: None)
    prov = VLLMProvider(RolloutKernels(4))
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(16).bfloat16()
    assert torch.equal(prov.layer_norm_float32(x, w, None, 1e-5), commandr.layer_norm_func(x, w, 1e-5))
    seen = []
    monkeypatch.setattr(commandr, "layer_norm_func", lambda h, weight, eps: seen.append(h) or h)
    assert prov.layer_norm_float32(x, w, None, 1e-5) is x and seen == [x]


def test_gate_records_carry_what_active_patches_chose(example, workdir, monkeypatch):
    """A record's environment names the active patches and, where one chose kernels at run time by a check it
    ran (gemm-fixed-order: cuBLAS or tic's kernel per problem), what it chose; nothing where none did."""
    from tic.config.schema import load_config
    from tic.gates import get
    from tic.skill import runner
    from tic.skill.context import GateContext

    ctx = GateContext(load_config(example("tiny-qwen3") / "tic-consistent.yaml"))
    assert "patch_choices" not in runner.run_gate(get("C0"), ctx).environment
    chosen = {"gemm-fixed-order": {"cublas_problems": 3, "fixed_order_kernel_problems": 2}}
    monkeypatch.setattr(runner.patches, "choices", lambda: chosen)
    assert runner.run_gate(get("C0"), ctx).environment["patch_choices"] == chosen
