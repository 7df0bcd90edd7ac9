"""Training step on CPU: tic's consistent kernels (forward = tic's row-wise CPU kernels, backward = the
surrogates of harness/kernels/autograd.py) vs a plain HF step, same model, weights and right-padded batch,
side by side in one run. The tic forward runs one token row per call (that is what makes it consistent), so
the step ratio is dominated by it on CPU; the backward columns are what the surrogates cost against plain
autograd. Also prints the gradient agreement of the two steps (min cosine, max relative error over
parameters; MoE routers of the plain step pinned to the tic step's top-k choices, as C7 does).

    .venv/bin/python benchmarks/bench_train_step.py [--batch 4 --seq 48 --repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def build(name: str, dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((EXAMPLES / name / "config.json").read_text())
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def batch(vocab: int, b: int, seq: int):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(seq // 2, seq + 1, (b,), generator=g).tolist()
    ids = torch.zeros(b, seq, dtype=torch.long)
    mask = torch.zeros(b, seq, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), torch.randn(b, generator=g)


def loss_of(model, ids, mask, pos, adv, log_softmax):
    """A policy-gradient loss on the next-token logprobs of the valid tokens (as the GPU step bench)."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, :-1]
    lp = log_softmax(logits.reshape(-1, logits.shape[-1])).reshape(*logits.shape)
    tok = lp.gather(-1, ids[:, 1:, None])[..., 0]
    valid = (mask[:, 1:] * mask[:, :-1]).to(tok.dtype)
    return -(adv[:, None] * tok * valid).sum() / valid.sum()


def timed_step(model, inputs, log_softmax, repeats: int) -> tuple[float, float]:
    """Median (forward s, backward s) of `repeats` steps after one warm-up."""
    fwd, bwd = [], []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_of(model, *inputs, log_softmax)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def backward_profile(model, inputs, log_softmax) -> list[tuple[str, float, int]]:
    """CPU time per tic.backward.<op> range over one step."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    loss = loss_of(model, *inputs, log_softmax)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    rows = [(r.key, r.cpu_time_total / 1e3, r.count) for r in prof.key_averages() if r.key.startswith("tic.backward.")]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also print CPU time per tic backward operator")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared machine: one thread keeps the two columns comparable

    from tic.harness.measure.gradcheck import RoutingPin, compare
    from tic.harness.kernels.modules import apply, capture_routes
    from tic.harness.kernels.providers import provider_for

    f32_log_softmax = lambda t: t.float().log_softmax(-1)  # noqa: E731
    print(f"torch {torch.__version__}, CPU, 1 thread; batch {args.batch} x {args.seq} (right padded), float32, "
          f"median of {args.repeats}")
    print(f"{'model':18s} {'plain fwd':>9s} {'plain bwd':>9s} {'tic fwd':>9s} {'tic bwd':>9s} "
          f"{'step x':>7s} {'bwd x':>6s} {'min cos':>9s} {'max rel':>8s}   (ms; x = tic / plain)")
    profiles = []
    for name in ("tiny-qwen3", "tiny-qwen3-moe"):
        plain = build(name, torch.float32)
        wrapped = apply(copy.deepcopy(plain), provider_for("consistent"))
        inputs = batch(plain.config.vocab_size, args.batch, args.seq)
        pf, pb = timed_step(plain, inputs, f32_log_softmax, args.repeats)
        tf, tb = timed_step(wrapped, inputs, wrapped._tic_ops.log_softmax, args.repeats)
        # gradients: the tic step, then the plain step with its routers pinned to the tic step's experts
        wrapped.zero_grad(set_to_none=True)
        with capture_routes(wrapped) as calls:
            loss_of(wrapped, *inputs, wrapped._tic_ops.log_softmax).backward()
        plain.zero_grad(set_to_none=True)
        pin = RoutingPin(plain)
        with pin.pinned({n: torch.cat(c) for n, c in calls.items()}) if pin.gates else contextlib.nullcontext():
            loss_of(plain, *inputs, f32_log_softmax).backward()
        rows = compare({n: p.grad for n, p in wrapped.named_parameters() if p.grad is not None},
                       {n: p.grad for n, p in plain.named_parameters() if p.grad is not None})
        print(f"{name:18s} {pf * 1e3:9.1f} {pb * 1e3:9.1f} {tf * 1e3:9.1f} {tb * 1e3:9.1f} "
              f"{(tf + tb) / (pf + pb):7.2f} {tb / pb:6.2f} {min(r['cosine'] for r in rows):9.6f} "
              f"{max(r['rel_error'] for r in rows):8.1e}")
        if args.profile:
            profiles.append((name, backward_profile(wrapped, inputs, wrapped._tic_ops.log_softmax)))
    for name, rows in profiles:
        print(f"\n{name}: CPU time per tic backward operator, one step")
        for key, ms, count in rows:
            print(f"  {key:28s} {ms:8.1f} ms  {count:4d} calls")


if __name__ == "__main__":
    main()
