"""Rollout throughput on the GPU: vLLM as users run it against tic's consistent rollout and vLLM's batch-invariant
mode, full-depth models with dummy weights, sides alternating in one run.

  python benchmarks/gpu/rollout_throughput.py [--shapes Qwen3-8B,Qwen3-30B-A3B] [--sides consistent,batch_invariant]
                                              [--workloads 512:256,256:2048] [--requests 256] [--rounds 3]
                                              [--memory-gb 125] [--out FILE.json]

Sides (each a vLLM engine in a process of its own; `default` is every ratio's denominator):
- default: vLLM's defaults (compilation mode 3, FULL_AND_PIECEWISE), no tic setting;
- consistent: tic's three patches, vLLM's default compilation with its CUDA kernels kept (custom_ops [all],
  vllm_c norms): the compiled mode in which C3-C5 pass (docs/results/shape-sweep.md);
- consistent_graph: the patches, CUDA graphs without compilation (mode 0, FULL_DECODE_ONLY);
- batch_invariant: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1), default compilation.
Models: each shape at its full depth (shapes.py), `load_format: dummy`. Workloads: `input:output` tokens, all
requests submitted at once, temperature 1, ignore_eos. Where two sides fit on the GPU beside each other
(estimated), default and the side run at once and take turns, pass by pass (ABAB...); otherwise each pass is a
fresh process, in the order default, side, side, default, ... Prints, per model, workload and side, tokens/s per
pass and the side/default ratio (median, min, max over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from configs import MODES, PATCHES as TIC_PATCHES  # noqa: E402
from shapes import Shape, by_name  # noqa: E402

PATCHES = ",".join(TIC_PATCHES)
KEEP_KERNELS = {k: v for k, v in MODES["compiled"].items() if k != "enforce_eager"}
SIDES = {
    "default": ({}, {"TIC_PATCHES": "", "VLLM_BATCH_INVARIANT": "0"}),
    "consistent": (KEEP_KERNELS, {"TIC_PATCHES": PATCHES, "VLLM_BATCH_INVARIANT": "0"}),
    "consistent_graph": ({"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
                         {"TIC_PATCHES": PATCHES, "VLLM_BATCH_INVARIANT": "0"}),
    "batch_invariant": ({}, {"TIC_PATCHES": "", "VLLM_BATCH_INVARIANT": "1"}),
}
GiB = 1 << 30


# -- one side: a process that starts its engine, then runs one timed pass per line it reads -------------------------
def child(model_dir: str, options: str, kv_bytes: int, max_len: int) -> None:
    import time

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tic import patches

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", seed=0,
              max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False,
              **json.loads(options))
    wanted = patches.parse_names(os.environ.get("TIC_PATCHES"))
    if sorted(patches.active()) != sorted(wanted):
        raise SystemExit(f"patches requested {wanted}, active {patches.active()}")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    print(json.dumps({"ready": True, "active_patches": patches.active()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        g = torch.Generator().manual_seed(req["seed"])
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, vocab, (req["input"],), generator=g).tolist())
                   for _ in range(req["requests"])]
        sp = SamplingParams(temperature=1.0, max_tokens=req["output"], ignore_eos=True, detokenize=False, seed=1)
        if req.get("warmup"):
            llm.generate(prompts[: max(1, len(prompts) // 8)], sp, use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"tok_s": tokens / dt, "seconds": dt, "tokens": tokens}), flush=True)


class Side:
    def __init__(self, name: str, model_dir: Path, shape: Shape, kv_bytes: int, max_len: int):
        options, env = SIDES[name]
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "child", str(model_dir), json.dumps(options), str(kv_bytes), str(max_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"side {self.name} ended (exit {self.proc.wait()})")

    def run(self, work: dict) -> dict:
        self.proc.stdin.write(json.dumps(work) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=300)


def weights_gib(s: Shape, layers: int) -> float:
    return 2 * s.params(layers) / GiB


def measure(shape: Shape, layers: int, side: str, work: dict, rounds: int, kv_bytes: int, memory_gb: float,
            model_dir: Path, max_len: int) -> dict:
    """`rounds` passes of default and of `side` each, taking turns."""
    got: dict[str, list[float]] = {"default": [], side: []}
    together = 2 * (weights_gib(shape, layers) + kv_bytes / GiB + 6) <= memory_gb
    if together:
        sides = {n: Side(n, model_dir, shape, kv_bytes, max_len) for n in ("default", side)}
        try:
            for n in sides:
                sides[n].run({**work, "warmup": True})  # compile and graph capture out of the timed passes
            for r in range(rounds):
                for n in (("default", side) if r % 2 == 0 else (side, "default")):
                    got[n].append(sides[n].run(work)["tok_s"])
        finally:
            for s in sides.values():
                s.close()
    else:
        for r in range(rounds):
            for n in (("default", side) if r % 2 == 0 else (side, "default")):
                one = Side(n, model_dir, shape, kv_bytes, max_len)
                try:
                    one.run({**work, "warmup": True})
                    got[n].append(one.run(work)["tok_s"])
                finally:
                    one.close()
    ratios = [c / b for b, c in zip(got["default"], got[side])]
    return {"shape": shape.name, "layers": layers, "side": side, "workload": f"{work['input']}:{work['output']}",
            "requests": work["requests"], "together": together, "tok_s": got,
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "all": ratios}}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="Qwen3-8B,Qwen3-30B-A3B")
    ap.add_argument("--sides", default="consistent,batch_invariant")
    ap.add_argument("--workloads", default="512:256,256:2048")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gb", type=float, default=20.0)
    ap.add_argument("--memory-gb", type=float, default=125.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    unknown = [s for s in a.sides.split(",") if s not in SIDES or s == "default"]
    if unknown:
        raise SystemExit(f"unknown side {unknown[0]!r}; sides: {', '.join(n for n in SIDES if n != 'default')}")
    results = []
    for shape in by_name(a.shapes.split(",")):
        layers = shape.layers
        model_dir = Path(tempfile.mkdtemp(prefix=f"tput-{shape.slug}-"))
        (model_dir / "config.json").write_text(json.dumps(shape.config(layers=layers)))
        for wl in a.workloads.split(","):
            inp, outp = (int(x) for x in wl.split(":"))
            work = {"input": inp, "output": outp, "requests": a.requests, "seed": 0}
            for side in a.sides.split(","):
                res = measure(shape, layers, side, work, a.rounds, int(a.kv_gb * GiB), a.memory_gb, model_dir,
                              inp + outp)
                results.append(res)
                print(json.dumps(res), flush=True)
    print(f"\n| model (layers) | workload | side | default tok/s | side tok/s | side / default: median (min-max) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        med = lambda v: statistics.median(v)  # noqa: E731
        q = r["ratio"]
        print(f"| {r['shape']} ({r['layers']}) | {r['workload']} x {r['requests']} | {r['side']} | "
              f"{med(r['tok_s']['default']):.0f} | {med(r['tok_s'][r['side']]):.0f} | "
              f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) |")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
