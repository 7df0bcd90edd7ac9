"""What one Mamba-2 layer's decode step costs on vLLM's kernels: vLLM's single-step update against
mamba-decode-replay's step (each request's chunk through the chunked scan), and what each config of the SSD kernels'
autotune lists makes of the step and of a prefill. No vLLM engine, no model: one mixer's kernels at a real shape.

  python benchmarks/gpu/mamba_step_bench.py [--shape nemotron-h-8b] [--rows 64] [--prefill 64:512] [--kernels all]

Every process pins the same SSD config (mamba-ssd-fixed-config: the first of each list), so any config of the
lists keeps C4 and C5 exact; the choice is speed alone. Rows printed (GPU microseconds, calls captured in a CUDA
graph, the median of its replays):
  vllm decode        selective_state_update for `rows` requests (the default side's decode of one layer)
  replay without its scan  the replay step with a scan that does nothing: its streams (gathers and masks of the
                     chunk buffers), the row picks and the state and buffer updates
  KERNEL config i    the replay step and the prefill with KERNEL pinned to config i of its list, every other SSD
                     kernel to its first (config 0 of all: what the consistent side runs now)
The ratio column is each row's replay step over config 0's.
"""

from __future__ import annotations

import argparse

from mamba_replay_probe import SHAPES
from row_norm_bench import timed_us


def _step_inputs(rows: int, H: int, P: int, N: int, G: int, Q: int, slots: int):
    """A decode batch of `rows` requests whose chunks hold 0..Q-1 tokens (spread), the last row padding (slot -1),
    and the replay's per-slot state: (store, state, slots, x, dt, A, B, C, D, dt_bias, out)."""
    import torch

    from tic.patches.vllm import mamba_decode_replay as replay

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, d=torch.bfloat16: torch.randn(*s, device="cuda", generator=g).to(d)  # noqa: E731
    counts = torch.arange(slots, device="cuda", dtype=torch.int32) * 37 % Q
    store = replay._Chunks(r(slots, Q, H, P), r(slots, Q, H) - 2, r(slots, Q, G, N), counts,
                           counts.long() + Q * (torch.arange(slots, device="cuda") % 3), None)
    ids = torch.arange(1, rows + 1, device="cuda", dtype=torch.int32)
    ids[-1] = -1
    A = -torch.exp(torch.rand(H, device="cuda", generator=g))
    return (store, r(slots, H, P, N, d=torch.float32) * 0.1, ids, r(rows, H, P), r(rows, H) - 2, A, r(rows, G, N),
            r(rows, G, N), r(H), r(H), torch.zeros(rows, H, P, dtype=torch.bfloat16, device="cuda"))


def _prefill_call(requests: int, length: int, H: int, P: int, N: int, G: int, Q: int):
    """A prefill of `requests` sequences of `length` tokens each through vLLM's chunked scan, as the mixer calls it."""
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen as scan

    from tic.patches.vllm.mamba_decode_replay import _streams

    g = torch.Generator(device="cuda").manual_seed(1)
    T = requests * length
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    x, dt, B, C, D, dt_bias = r(T, H, P), r(T, H) - 2, r(T, G, N), r(T, G, N), r(H), r(H)
    A = -torch.exp(torch.rand(H, device="cuda", generator=g))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    cu, chunks, last, seq = (i32(v) for v in _streams([length] * requests, Q))
    out = torch.empty_like(x)
    return lambda: scan(x, dt, A, B, C, chunk_size=Q, cu_seqlens=cu, cu_chunk_seqlens=chunks,
                        last_chunk_indices=last, seq_idx=seq, out=out, D=D, dt_bias=dt_bias, dt_softplus=True,
                        state_dtype=torch.float32)


def _pinned(kernel_index: int, config_index: int):
    """Pins every SSD kernel to its first config, kernel number `kernel_index` (of mamba-ssd-fixed-config's KERNELS)
    to config `config_index`; returns a function that gives every autotuner its list back."""
    from tic.patches.vllm import mamba_ssd_fixed_config as fixed

    kept = []
    for k, tuner in enumerate(fixed._tuners()):
        kept.append((tuner, tuner.configs))
        tuner.configs = [tuner.configs[config_index if k == kernel_index else 0]]
        tuner.cache.clear()

    def restore():
        for tuner, configs in kept:
            tuner.configs = configs
            tuner.cache.clear()
    return restore


def _describe(config) -> str:
    """A Triton config in a few characters: its tile sizes (BLOCK_SIZE_ dropped), warps and stages."""
    kwargs = getattr(config, "kwargs", None)
    if not isinstance(kwargs, dict):
        return str(config)
    tiles = " ".join(f"{k.replace('BLOCK_SIZE_', '')}{v}" for k, v in kwargs.items())
    return f"{tiles} w{getattr(config, 'num_warps', '?')} s{getattr(config, 'num_stages', '?')}"


def _vllm_decode(store, state, ids, x, dt, A, B, C, D, dt_bias, out):
    from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update

    P, N = x.shape[2], B.shape[2]
    Ae = A[:, None, None].expand(-1, P, N)  # stride 0 over P and N, as the mixer hands it (the kernel's fast path)
    dte, De, be = (v[..., None].expand(*v.shape, P) for v in (dt, D, dt_bias))
    idx = ids.clamp(min=0)[:, None].contiguous()
    return lambda: selective_state_update(state, x, dte, Ae, B, C, De, be, dt_softplus=True,
                                          state_batch_indices=idx, dst_state_batch_indices=idx, out=out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="nemotron-h-8b", choices=[s[0] for s in SHAPES])
    ap.add_argument("--rows", type=int, default=64, help="decode requests in the batch (the last one padding)")
    ap.add_argument("--prefill", default="64:512", help="REQUESTS:TOKENS of the timed prefill")
    ap.add_argument("--kernels", default="all", help="which SSD kernels' lists to sweep (names, comma-separated)")
    a = ap.parse_args()
    from tic.patches.vllm import mamba_ssd_fixed_config as fixed

    names = [attr for _, attr in fixed.KERNELS]
    wanted = names if a.kernels == "all" else a.kernels.split(",")
    if unknown := sorted(set(wanted) - set(names)):
        ap.error(f"--kernels: no SSD kernel named {', '.join(unknown)} (known: {', '.join(names)})")
    if a.rows < 2:
        ap.error("--rows: at least 2 (the last row is padding)")
    try:
        requests, length = (int(v) for v in a.prefill.split(":"))
    except ValueError:
        ap.error(f"--prefill: REQUESTS:TOKENS, got {a.prefill!r}")
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen as scan

    from tic.patches.vllm import mamba_decode_replay as replay

    _, H, P, N, G, Q, _ = next(s for s in SHAPES if s[0] == a.shape)
    args = _step_inputs(a.rows, H, P, N, G, Q, a.rows + 1)
    store, state, ids, x, dt, A, B, C, D, dt_bias, out = args
    step = lambda: replay._decode_step(scan, store, state, ids, x, dt, A, B, C, D, dt_bias, out, Q)  # noqa: E731
    prefill = _prefill_call(requests, length, H, P, N, G, Q)
    print(f"{a.shape}: H={H} P={P} N={N} G={G} chunk {Q}; decode {a.rows} rows; prefill {requests} x {length}")
    print(f"{'case':<42} {'config':<52} {'step us':>9} {'vs cfg 0':>8} {'prefill us':>11}")
    print(f"{'vllm decode':<42} {'(its own)':<52} {timed_us(_vllm_decode(*args)):>9.1f}")
    ends = torch.zeros(a.rows, H, P, N, device="cuda")
    no_scan = lambda *pos, **kw: ends  # noqa: E731  (the step around the scan: streams, picks, state updates)
    around = lambda: replay._decode_step(no_scan, store, state, ids, x, dt, A, B, C, D, dt_bias, out, Q)  # noqa: E731
    print(f"{'replay without its scan':<42} {'':<52} {timed_us(around):>9.1f}")
    base = None
    for k, tuner in enumerate(fixed._tuners()):
        if names[k] not in wanted:
            continue
        for i, config in enumerate(tuner.configs):
            restore = _pinned(k, i)
            try:
                us, pre = timed_us(step), timed_us(prefill, calls=3, repeats=7)
            except Exception as e:  # a config this shape cannot run: say so and go on
                print(f"{names[k] + ' config ' + str(i):<42} {_describe(config):<52} failed: {type(e).__name__}: {e}")
                continue
            finally:
                restore()
            base = us if base is None else base
            print(f"{names[k] + ' config ' + str(i):<42} {_describe(config):<52} {us:>9.1f} {us / base:>8.3f} "
                  f"{pre:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
