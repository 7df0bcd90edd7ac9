"""A dense bf16/fp16 GEMM (y = x @ w.T [+ b]) whose every output element is summed over K in one order for every M.

Each program owns a BLOCK_M x BLOCK_N tile of y and walks K from 0 upwards in steps of BLOCK_K, accumulating in
float32 with tensor-core MMAs; there is no split-K and no reduction across programs, so an element's value depends
on its row of x, its row of w and the MMA chain over K, never on how many rows the batch has. On the H200 (Triton
3.6) every tile shape tried, 16-128 rows x 32-256 columns x K steps of 32-128, pointer loads or TMA, one program
per tile or persistent, gave the same bits on seven projection shapes (benchmarks/gpu/gemm_order_probe.py,
docs/results/rollout-throughput.md). So the tile may follow the batch size for speed; `linear` still takes a tile
only after checking, on seeded operands of that problem, that it reproduces the reference tile's bits, and falls
back to the reference tile where one does not.

cuBLAS's own kernels mostly sum K in that same chain. On the H100 its rows equal the reference tile's at every
batch size probed (1 to 8,192 rows) on Qwen3-8B's qkv and gate_up and Qwen3-30B-A3B's qkv, and from 128 rows up on
every projection probed; for fewer rows on the narrow, deep ones (o, down) its heuristic picks kernels that sum in
another order (benchmarks/gpu/cublas_order_probe.py). So `linear` runs cuBLAS for a problem once a check on seeded
operands of exactly that problem (rows, weight, dtypes, bias, the addresses' alignment, which cuBLAS picks kernels
by) gave the reference tile's bits, and tic's kernel otherwise. Every process checks for itself, so a row's bits
are the reference tile's whichever kernel ran it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from tic.patches.vllm._decided import counts, decided
from tic.patches.vllm._triton_options import PINNED


class Tile(NamedTuple):
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    tma: bool = True
    persistent: bool = False


REFERENCE = Tile(128, 256, 64, 8, 3, tma=False)
# candidates by batch size (rows up to): the fastest of each list for a problem is measured once, on the device
CANDIDATES = (
    # decode: a weight of N rows gives N / BLOCK_N programs, so narrow tiles with long K steps keep every SM
    # streaming weights (cuBLAS splits K there instead, which would change the order)
    (16, (Tile(16, 32, 128, 4, 4, tma=False), Tile(16, 64, 128, 4, 4, tma=False), Tile(16, 128, 128, 4, 4),
          Tile(16, 16, 256, 2, 4, tma=False), Tile(16, 32, 256, 4, 3, tma=False))),
    (64, (Tile(64, 32, 128, 4, 4, tma=False), Tile(64, 64, 64, 4, 4, tma=False), Tile(64, 64, 128, 4, 4),
          Tile(64, 128, 128, 4, 4))),
    (256, (Tile(64, 128, 128, 4, 4), Tile(64, 64, 64, 4, 4), Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3),
           Tile(64, 256, 64, 4, 4, persistent=True))),
    (1024, (Tile(128, 256, 64, 8, 3), Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3, persistent=True),
            Tile(64, 128, 128, 4, 4))),
    (1 << 62, (Tile(128, 256, 64, 8, 3), Tile(128, 256, 64, 8, 3, persistent=True), Tile(128, 128, 64, 8, 3))),
)


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (tic imports this module on machines without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles share each weight tile while it is in L2
        per_group = GROUP_M * grid_n
        group = pid // per_group
        first_m = group * GROUP_M
        size_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # 64-bit offsets: a training batch's logits (tokens x vocab) pass 2**31 elements
        rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
        x_tile = x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk
        w_tile = w_ptr + rn64[None, :] * swn + rk[:, None] * swk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(x_tile, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
            b = tl.load(w_tile, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
            acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K * sxk
            w_tile += BLOCK_K * swk
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm64[:, None] * sym + rn64[None, :] * syn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return _gemm_kernel



@functools.cache
def _tma_kernel():
    """The same K chain with TMA loads and stores (Hopper's bulk copy engine), optionally persistent: programs
    walk output tiles with a stride (STEP = number of programs) instead of one program per tile."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "STEP"])
    def _gemm_tma(x_desc, w_desc, y_desc, b_ptr, M, N, K, STEP, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, OUT_BF16: tl.constexpr):
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * grid_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), grid_m * grid_n, STEP):
            group = tile // per_group
            first_m = group * GROUP_M
            size_m = min(grid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % size_m
            pid_n = (tile % per_group) // size_m
            om = pid_m * BLOCK_M
            on = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x_desc.load([om, ki * BLOCK_K])
                b = w_desc.load([on, ki * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            if HAS_BIAS:
                rn = on + tl.arange(0, BLOCK_N)
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if OUT_BF16:
                y_desc.store([om, on], acc.to(tl.bfloat16))
            else:
                y_desc.store([om, on], acc.to(tl.float16))

    return _gemm_tma


def run(x2, weight, bias, tile: Tile):
    """y = x2 @ weight.T (+ bias) for a 2-D x2 with one tile; TMA needs 16-byte aligned rows and bases."""
    import torch

    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if not m:
        return y
    tiles = -(-m // tile.bm) * -(-n // tile.bn)
    if tile.tma and _tma_ok(x2, weight, y):
        from triton.tools.tensor_descriptor import TensorDescriptor

        progs = min(tiles, _sms(x2.device)) if tile.persistent else tiles
        desc = TensorDescriptor.from_tensor
        _tma_kernel()[(progs,)](
            desc(x2, [tile.bm, tile.bk]), desc(weight, [tile.bn, tile.bk]), desc(y, [tile.bm, tile.bn]),
            bias if bias is not None else y, m, n, k, progs,
            HAS_BIAS=bias is not None, BLOCK_M=tile.bm, BLOCK_N=tile.bn, BLOCK_K=tile.bk, GROUP_M=8,
            OUT_BF16=x2.dtype == torch.bfloat16, num_warps=tile.warps, num_stages=tile.stages, **PINNED)
    else:
        _kernel()[(tiles,)](
            x2, weight, bias if bias is not None else y, y, m, n, k, x2.stride(0), x2.stride(1), weight.stride(0),
            weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None, BLOCK_M=tile.bm,
            BLOCK_N=tile.bn, BLOCK_K=tile.bk, GROUP_M=8, num_warps=tile.warps, num_stages=tile.stages, **PINNED)
    return y


def _tma_ok(*ts) -> bool:
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


@functools.cache
def _sms(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _bucket(m: int) -> int:
    for bound, _ in CANDIDATES:
        if m <= bound:
            return bound
    return CANDIDATES[-1][0]


_chosen: dict = {}


def tile_for(m: int, weight, x_dtype, has_bias: bool) -> Tile:
    """The tile a problem of m rows runs: the fastest candidate of m's size class whose bits equal the reference
    tile's on seeded rows against the layer's weight (measured once per class, weight shape and dtype).
    While a CUDA graph is being captured an unmeasured class takes the reference tile (measuring would launch
    work into the graph); its bits are the same."""
    bound = _bucket(m)
    key = (bound, weight.shape, weight.dtype, x_dtype, has_bias, weight.device)
    rows = max(1, min(bound, 4096, (1 << 28) // weight.shape[0]))  # the lm_head's logits stay under 512 MiB
    return decided(_chosen, key, lambda: _measure(dict(CANDIDATES)[bound], rows, weight, x_dtype, has_bias),
                   weight.is_cuda, REFERENCE)


def _measure(candidates, m: int, w, x_dtype, has_bias: bool) -> Tile:
    """The fastest of `candidates` on seeded rows against the layer's own weight (no weight-sized copy); the data
    can only change which equal-bits tile is fastest, never a value."""
    import torch
    import triton.testing

    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(m, w.shape[1], generator=g, device=w.device, dtype=x_dtype)
    b = torch.randn(w.shape[0], generator=g, device=w.device, dtype=x_dtype) if has_bias else None
    want = run(x, w, b, REFERENCE)
    times = {}
    for t in candidates:
        try:
            if torch.equal(run(x, w, b, t), want):
                times[t] = triton.testing.do_bench(lambda t=t: run(x, w, b, t), warmup=2, rep=8)
        except Exception:  # a tile this device cannot build (shared memory) is no candidate  # noqa: BLE001
            continue
    return min(times, key=times.get) if times else REFERENCE


# A problem whose output passes this (the lm_head over a training batch) stays on tic's kernel. The check holds one
# output of the problem's size (the reference is computed CHECK_ROWS rows at a time), 1 GiB in bf16 at most: a
# prefill step's widest projection (16,384 rows of Qwen3-8B's gate_up, 402 M elements) is checked.
CUBLAS_CHECK_ELEMENTS = 1 << 29
CHECK_ROWS = 2048
_cublas_ok: dict = {}


def _cublas(x2, weight, bias):
    import torch.nn.functional as F

    return F.linear(x2, weight, bias)


def _alignment(t) -> int:
    """The largest power of two up to 256 dividing t's address: cuBLAS chooses among kernels by it."""
    a = 256
    while t.data_ptr() % a:
        a //= 2
    return a


def checks() -> dict:
    """The cuBLAS checks this process ran: problems that run cuBLAS, problems that run tic's kernel."""
    return counts(_cublas_ok, "cublas_problems", "fixed_order_kernel_problems")


def cublas_agrees(x2, weight, bias) -> bool:
    """Whether cuBLAS gives the reference tile's bits for this problem: checked once per (rows, weight shape,
    dtypes, bias, alignments) on seeded rows of x2's alignment against the layer's own weight. No for a strided
    operand (cuBLAS may take another kernel than the check saw), past CUBLAS_CHECK_ELEMENTS, and for an unchecked
    problem while a CUDA graph is captured (checking would launch into the graph)."""
    m, n = x2.shape[0], weight.shape[0]
    if not (x2.is_cuda and x2.is_contiguous() and weight.is_contiguous()) or not m or m * n > CUBLAS_CHECK_ELEMENTS:
        return False
    key = (m, weight.shape, weight.dtype, x2.dtype, bias is not None, _alignment(x2), _alignment(weight),
           weight.device)
    return decided(_cublas_ok, key, lambda: _cublas_check(m, weight, x2.dtype, bias is not None, _alignment(x2)),
                   True, False)


def _cublas_check(m: int, w, x_dtype, has_bias: bool, align: int) -> bool:
    import torch

    g = torch.Generator(device=w.device).manual_seed(0)
    k, size = w.shape[1], torch.empty((), dtype=x_dtype).element_size()
    skip = align // size if align < 256 else 0  # the allocator's blocks start 512-aligned: this sets x's alignment
    flat = torch.randn(skip + m * k, generator=g, device=w.device, dtype=x_dtype)
    x = flat[skip:].view(m, k)
    b = torch.randn(w.shape[0], generator=g, device=w.device, dtype=x_dtype) if has_bias else None
    got = _cublas(x, w, b)
    # the reference tile's rows do not depend on how many rows share its launch, so pieces of them are its bits
    return all(torch.equal(got[s:s + CHECK_ROWS], run(x[s:s + CHECK_ROWS], w, b, REFERENCE))
               for s in range(0, m, CHECK_ROWS))


def linear(x, weight, bias=None):
    """x [.., K] @ weight[N, K].T (+ bias) in x's dtype, one K order for every number of rows."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if cublas_agrees(x2, weight, bias):
        y = _cublas(x2, weight, bias)
    else:
        y = run(x2, weight, bias, tile_for(x2.shape[0], weight, x.dtype, bias is not None))
    return y.view(*x.shape[:-1], weight.shape[0])
