"""One GPU run: a training step (forward + backward) of tic's Megatron engine on vLLM's kernels against plain
Megatron-core on its local layer spec (Megatron's own attention, norms, MLP or MoE and GEMMs): the same GPTModel
configuration (tic.harness.engines.megatron.transformer_config), the same converted weights, the same batch, on a
4-layer cut with a public model's layer shapes (shapes.py; Qwen3-8B by default).

  source benchmarks/gpu/device_env.sh && megatron_install     # tic, the vLLM bundle and megatron-core on the path
  [TIC_PATCHES=...] python3 benchmarks/gpu/megatron_step_bench.py [--shape Qwen3-8B] [--layers 4] \
    [--batch 4 --seq 1024] [--warmup 3 --repeats 10]

The step is the policy-gradient step of tic's train engine: forward, log-softmax of the next-token logits (tic's
kernel on tic's side, float32 torch on the plain one), advantage-weighted loss over the valid tokens, backward.
After the warm-up the two sides alternate, in the order tic, plain, plain, tic, ... (a drift in clocks, memory or
caches falls on both); the table has each side's median step time with its min..max, and the ratio tic/plain as the
median of the per-pair ratios, with their min..max.
`--tiny --device cpu --kernels consistent` runs it on a tiny Qwen3 on the CPU: a check that it runs, not a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from shapes import SHAPES

PLAIN = "plain Megatron-core (local spec)"
TIC = "tic Megatron on {kernels} kernels"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="Qwen3-8B", choices=[s.name for s in SHAPES if s.model_type in
                                                            ("qwen3", "qwen3_moe", "llama")],
                    help="the public model whose layer shapes the cut has (shapes.py)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024, help="the longest sequence; others are 1/2 to all of it")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="steps of each side, alternated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", default="vllm", choices=["vllm", "consistent"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/tic-gpu/megatron-step"),
                    help="where the cut's config.json and seeded weights are written")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of --shape (a CPU check)")
    args = ap.parse_args(argv)
    if min(args.layers, args.batch, args.seq, args.repeats) < 1 or args.warmup < 0:
        ap.error("--layers, --batch, --seq and --repeats are at least 1, --warmup at least 0")
    return args


def model_dir(args) -> Path:
    """The cut's folder: config.json from shapes.py (or a tiny Qwen3) with seeded weights (tic's generator)."""
    if args.tiny:
        from tic.harness.testing.tinymodels import tiny_model

        return tiny_model(1, "qwen3")[0]
    from tic.harness.model.generate import generate_model

    shape = next(s for s in SHAPES if s.name == args.shape)
    config_dir = args.work / f"{shape.slug}-{args.layers}l"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(shape.config(args.layers, "bfloat16"), indent=1))
    return generate_model(config_dir, 0)


def plain_model(tic_model, dtype: torch.dtype, device: str):
    """Megatron-core's GPTModel on its local spec, the tic model's TransformerConfig and weights, Megatron's own
    rotary embedding (the config's rope_theta), Megatron's default (non-deterministic) settings; no random
    initialisation (the weights are loaded)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tic.harness.engines.megatron import transformer_config

    cfg = tic_model.model_cfg
    tc = dataclasses.replace(transformer_config(cfg, dtype), deterministic_mode=False, perform_initialization=False)
    spec = get_gpt_layer_local_spec(num_experts=tc.num_moe_experts, qk_layernorm=tc.qk_layernorm,
                                    normalization="RMSNorm")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    model = GPTModel(tc, spec, vocab_size=int(cfg["vocab_size"]),
                     max_sequence_length=int(cfg.get("max_position_embeddings") or 4096),
                     position_embedding_type="rope", rotary_base=int(rope),
                     share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")))
    state = {k: v for k, v in tic_model.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SystemExit(f"plain Megatron: the tic model's weights do not fit (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return model.to(device).train().requires_grad_(True)


def batch(args, vocab: int):
    """Right-padded sequences of seq/2..seq tokens, their padding mask and positions, one advantage each."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(max(args.seq // 2, 1), args.seq + 1, (args.batch,), generator=g).tolist()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    mask = torch.zeros(args.batch, args.seq, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, :n] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.randn(args.batch, generator=g)
    return tuple(t.to(args.device) for t in (ids, mask, pos, adv))


def step(model, logits_of, log_softmax, data) -> None:
    """Forward, advantage-weighted next-token logprobs of the valid tokens, backward."""
    ids, mask, pos, adv = data
    model.zero_grad(set_to_none=True)
    logits = logits_of(ids, mask, pos)[:, :-1]
    lp = log_softmax(logits.reshape(-1, logits.shape[-1])).reshape(*logits.shape)
    tok = lp.gather(-1, ids[:, 1:, None])[..., 0]
    valid = (mask[:, 1:] * mask[:, :-1]).to(tok.dtype)
    (-(adv[:, None] * tok * valid).sum() / valid.sum()).backward()


def alternate(steps: dict, warmup: int, repeats: int, sync) -> dict[str, list[float]]:
    """Seconds per step of each side: `warmup` untimed rounds, then `repeats` timed ones in the order A B, B A, ..."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            sync()
            t = time.perf_counter()
            steps[n]()
            sync()
            times[n].append(time.perf_counter() - t)
    return times


def summary(times: dict[str, list[float]], tic: str, plain: str) -> dict:
    """Median and min..max per side; the ratio tic/plain over the pairs of the same round."""
    ratios = [a / b for a, b in zip(times[tic], times[plain])]
    return {"sides": {n: (statistics.median(t), min(t), max(t)) for n, t in times.items()},
            "ratio": (statistics.median(ratios), min(ratios), max(ratios)), "pairs": len(ratios)}


def table(s: dict) -> str:
    lines = [f"| {'side':38s} | {'median ms':>10s} | {'min..max ms':>17s} |", f"|{'-' * 40}|{'-' * 12}|{'-' * 19}|"]
    for name, (med, lo, hi) in s["sides"].items():
        lines.append(f"| {name:38s} | {1e3 * med:10.2f} | {f'{1e3 * lo:.2f}..{1e3 * hi:.2f}':>17s} |")
    med, lo, hi = s["ratio"]
    lines.append(f"ratio tic/plain: {med:.3f}x (per-pair min..max {lo:.3f}..{hi:.3f}, {s['pairs']} pairs)")
    return "\n".join(lines)


def same_model(logits: dict[str, torch.Tensor], mask: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the two sides compute one model: their logits on the batch's tokens within C2's fidelity bound for
    the dtype (tic.harness.measure.fidelity), the plain side as the reference."""
    from tic.harness.measure.fidelity import FIDELITY_ATOL, FIDELITY_RTOL

    got, ref = (t[mask.bool()].float() for t in logits.values())
    diff, bound = float((got - ref).abs().max()), FIDELITY_RTOL[dtype] * float(ref.abs().max()) + FIDELITY_ATOL
    return diff <= bound, f"max |tic - plain| of the logits {diff:.3g} (bound {bound:.3g}, C2's rtol for {dtype})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL: no CUDA GPU")
        return 1
    import megatron.core

    from tic.config.schema import BackwardConfig
    from tic.harness.engines.megatron import block_causal_mask, init_parallel_state, load_megatron_model

    if args.device.startswith("cuda"):  # Megatron's attention forks the model-parallel CUDA RNG (its dropout)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        init_parallel_state(args.device)  # the seed is per tensor-parallel rank: the groups come first
        model_parallel_cuda_manual_seed(0)
    path = model_dir(args)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    tic_model = load_megatron_model(path, dtype, args.kernels, args.device, 16, BackwardConfig(), trainable=True)
    tic_model.train()
    plain = plain_model(tic_model, getattr(torch, dtype), args.device)
    data = batch(args, int(tic_model.model_cfg["vocab_size"]))
    cfg = tic_model.model_cfg
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {args.device}"
          f"{' ' + torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}; "
          f"{'tiny qwen3' if args.tiny else args.shape} cut: {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}, {dtype}; batch {args.batch} x {args.seq} (right "
          f"padded), {args.repeats} steps each after {args.warmup} warm-up rounds")
    tic = TIC.format(kernels=args.kernels)
    logits_of = {tic: lambda i, m, p: tic_model(input_ids=i, attention_mask=m, position_ids=p).logits,
                 PLAIN: lambda i, m, p: plain(input_ids=i, position_ids=p, attention_mask=~block_causal_mask(m, p))}
    with torch.no_grad():
        same, line = same_model({n: f(*data[:3]) for n, f in logits_of.items()}, data[1], getattr(torch, dtype))
    print(f"{'ok  ' if same else 'FAIL'} same model: {line}")
    f32_log_softmax = lambda t: t.float().log_softmax(-1)  # noqa: E731
    steps = {tic: lambda: step(tic_model, logits_of[tic], tic_model._tic_ops.log_softmax, data),
             PLAIN: lambda: step(plain, logits_of[PLAIN], f32_log_softmax, data)}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(table(summary(alternate(steps, args.warmup, args.repeats, sync), tic, PLAIN)))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
