"""Rollout throughput on the GPU: vLLM as users run it against tic's consistent rollout and vLLM's batch-invariant
mode, full-depth models with dummy weights, sides alternating in one run.

  python benchmarks/gpu/rollout_throughput.py [--shapes Qwen3-8B,Qwen3-30B-A3B] [--sides consistent,batch_invariant]
                                              [--workloads 512:256,256:2048:64] [--requests 256] [--rounds 3]
                                              [--kv-gb 22 | 0: fit] [--memory-gb GPU-8] [--fp8] [--out FILE.json]
                                              [--profile-tokens N] [--previous-pythonpath P]

Sides (each a vLLM engine in a process of its own; `default` is every ratio's denominator):
- default: vLLM's defaults (compilation mode 3, FULL_AND_PIECEWISE), no tic setting;
- consistent: tic's three patches, vLLM's default compilation with its CUDA kernels kept (custom_ops [all],
  vllm_c norms): the compiled mode in which C3-C5 pass (docs/results/shape-sweep.md);
- consistent_graph: the patches, CUDA graphs without compilation (mode 0, FULL_DECODE_ONLY);
- batch_invariant: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1), default compilation;
- keep_kernels: the consistent side's compilation settings without any patch (what keeping the CUDA ops costs);
- only:P1+P2: the consistent side's compilation with only the named patches (one patch's cost, A/B);
- fixed-block: the consistent side (FP8 or hybrid alike) with rmsnorm-fixed-block in place of rmsnorm-rows (the
  two norm fixes' A/B);
- previous: the consistent side run on another tic tree (--previous-pythonpath, device_env.sh's previous_tree:
  a patch change's with/without in one run).
Models: each shape at its full depth (shapes.py), `load_format: dummy`, every side with the same KV cache size;
a Mamba-2 hybrid (shapes.HYBRID_SHAPES, e.g. --shapes Nemotron-H-8B --workloads 512:256:64,256:2048:64): its
consistent side runs the Mamba patches with full CUDA graphs of the decode steps (HYBRID_CONSISTENT, what C0
accepts), every side max_num_seqs = the largest workload's requests (vLLM refuses more slots than states);
--fp8: block-FP8 weights (config.json's quantization_config as Qwen3-*-FP8 ship it, 128x128 blocks) and an FP8 KV
cache (kv_cache_dtype fp8) on every side, so the ratios are FP8 consistent (or batch-invariant) over FP8 default.
Workloads: `input:output[:requests]` tokens, all requests submitted at once, temperature 1, ignore_eos. Where all
sides fit on the GPU together (estimated), they are resident at once (started concurrently) and take turns pass by
pass, the order rotated each round; otherwise each side is a process of its own in turn, default first and last.
A warm-up pass per side and workload keeps compilation and graph capture out of the timing. Prints, per model,
workload and side, tokens/s and the side's passes over the default's median (median, min, max over rounds);
the JSON keeps beside each ratio what the side's patches chose at run time (`patch_choices`). --profile-tokens N
adds one untimed pass per side and workload under torch.profiler (N output tokens at most) and prints where each
side's GPU time goes, kernel by kernel, beside the default's.
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
from configs import FP8_PATCHES, MAMBA_PATCHES, MODES, PATCHES as TIC_PATCHES, with_norm  # noqa: E402
from shapes import HybridShape, Shape, by_name  # noqa: E402

from tic.harness.model.quantize import block_fp8_config, unquantized_linears  # noqa: E402

PATCHES = ",".join(TIC_PATCHES)
KEEP_KERNELS = {k: v for k, v in MODES["compiled"].items() if k != "enforce_eager"}
SIDES = {
    "default": ({}, {"TIC_PATCHES": "", "VLLM_BATCH_INVARIANT": "0"}),
    "consistent": (KEEP_KERNELS, {"TIC_PATCHES": PATCHES, "VLLM_BATCH_INVARIANT": "0"}),
    "consistent_graph": ({"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
                         {"TIC_PATCHES": PATCHES, "VLLM_BATCH_INVARIANT": "0"}),
    "batch_invariant": ({}, {"TIC_PATCHES": "", "VLLM_BATCH_INVARIANT": "1"}),
    "keep_kernels": (KEEP_KERNELS, {"TIC_PATCHES": "", "VLLM_BATCH_INVARIANT": "0"}),
}
# A hybrid's consistent rollout: the Mamba patches in the modes C0 accepts for the decode replay (full CUDA graphs
# of the decode steps, no torch.compile), the SSM state between chunks in float32 as the training side keeps it
HYBRID_CONSISTENT = {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                     "mamba_ssm_cache_dtype": "float32"}  # LLM(...)'s own keywords


def side_spec(name: str, fp8: bool = False, previous: str = "", hybrid: bool = False) -> tuple[dict, dict]:
    """A named side, or `only:P1+P2`: the consistent side's compilation with only those patches (A/B one patch).
    fp8: the sides with tic's patches take the FP8 ones too (configs.FP8_PATCHES); previous: the import path of
    the tic tree the `previous` side runs; hybrid: a Mamba-2 hybrid, whose sides with tic's patches run
    HYBRID_CONSISTENT with the Mamba patches (configs.MAMBA_PATCHES)."""
    if name.startswith("only:"):
        options, env = KEEP_KERNELS, {"TIC_PATCHES": name[5:].replace("+", ","), "VLLM_BATCH_INVARIANT": "0"}
    elif name in ("previous", "fixed-block"):
        options, env = SIDES["consistent"]
        env = {**env, "PYTHONPATH": previous} if name == "previous" else env
    else:
        options, env = SIDES[name]
    if fp8 and env["TIC_PATCHES"] == PATCHES:
        env = {**env, "TIC_PATCHES": ",".join(FP8_PATCHES)}
    if hybrid and env["TIC_PATCHES"]:
        options = HYBRID_CONSISTENT
        if env["TIC_PATCHES"] == PATCHES:
            env = {**env, "TIC_PATCHES": ",".join(MAMBA_PATCHES)}
    if name == "fixed-block":
        env = {**env, "TIC_PATCHES": ",".join(with_norm(env["TIC_PATCHES"].split(","), "rmsnorm-fixed-block"))}
    return options, env


GiB = 1 << 30


def gpu_total_gib() -> float:
    """The first GPU's memory, from nvidia-smi: the parent process must not hold a CUDA context of its own."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


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
    v2 = getattr(getattr(llm.llm_engine, "vllm_config", None), "use_v2_model_runner", None)
    print(json.dumps({"ready": True, "active_patches": patches.active(),
                      "model_runner": {True: "V2", False: "V1"}.get(v2, "unknown")}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        g = torch.Generator().manual_seed(req["seed"])
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, vocab, (req["input"],), generator=g).tolist())
                   for _ in range(req["requests"])]
        sp = SamplingParams(temperature=1.0, max_tokens=req["output"], ignore_eos=True, detokenize=False, seed=1)
        if req.get("profile"):  # an untimed pass under the profiler: where the side's GPU time goes
            print(json.dumps({"kernels": kernel_table(lambda: llm.generate(prompts, sp, use_tqdm=False))}),
                  flush=True)
            continue
        if req.get("warmup"):
            llm.generate(prompts[: max(1, len(prompts) // 8)], sp, use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"tok_s": tokens / dt, "seconds": dt, "tokens": tokens,
                          "patch_choices": patches.choices()}), flush=True)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::_scaled_mm", "tic::linear_fixed_order")


def kernel_table(run, top: int = 40) -> dict:
    """GPU time per kernel name (CUDA graph replays included) over one call of run(), the largest first, and the
    call's wall time (GPU time well below it: the side waits on its host). Also the GEMM problems launched outside
    CUDA graphs (prefill and mixed steps) by op and input shapes, with the GPU time of everything each launched:
    which problems run cuBLAS (aten::mm) and which tic's kernel (tic::linear_fixed_order without an aten::mm
    of the same shapes)."""
    import time

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = sorted(((e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0), key=lambda r: -r[2])
    gemms = sorted(((e.key, str(e.input_shapes), e.count, e.device_time_total)
                    for e in prof.key_averages(group_by_input_shape=True)
                    if e.key in GEMM_OPS and e.device_time_total > 0), key=lambda r: -r[3])
    return {"total_ms": sum(r[2] for r in rows) / 1e3, "wall_ms": wall * 1e3,
            # whole names: a template kernel's instantiations (FA3's split and pack-GQA variants) differ at the end
            "kernels": [{"name": k[:4000], "calls": c, "ms": t / 1e3} for k, c, t in rows[:top]],
            "gemm_problems": [{"op": k, "shapes": sh[:160], "calls": c, "ms": t / 1e3}
                              for k, sh, c, t in gemms[:top]]}


class Side:
    """A side's process; `start` returns at once, `wait_ready` blocks until its engine is up."""

    def __init__(self, name: str, model_dir: Path, kv_bytes: int, max_len: int, memory_fraction: float,
                 common: dict | None = None, fp8: bool = False, previous: str = "", hybrid: bool = False):
        options, env = side_spec(name, fp8, previous, hybrid)
        options = {**options, **(common or {}), "gpu_memory_utilization": round(memory_fraction, 3)}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "child", str(model_dir), json.dumps(options), str(kv_bytes), str(max_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})

    def wait_ready(self) -> dict:
        return self._read()

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


def weights_gib(s: Shape, layers: int, fp8: bool = False) -> float:
    """bf16 weights; with fp8 one byte per layer weight (the scales are a 1/16384 share), embeddings kept bf16."""
    if not fp8:
        return 2 * s.params(layers) / GiB
    return (s.params(layers) + s.params(0)) / GiB  # every weight's byte, and the embeddings' second one


def side_gib(shape: Shape, layers: int, kv_bytes: int, fp8: bool = False) -> float:
    """What one side holds on the GPU: weights, KV cache (a hybrid's decode-replay buffers are a state of its cache,
    so vLLM counts them in kv_bytes), and room for activations, graphs and the allocator."""
    return weights_gib(shape, layers, fp8) + kv_bytes / GiB + 6


def shared_kv_gib(shape: Shape, layers: int, sides: int, memory_gb: float, fp8: bool = False) -> float:
    """The largest whole-GiB KV cache with which `sides` engines fit in memory_gb together (side_gib), at least
    4 GiB; else 22 GiB (the sides then run in turn)."""
    kv = int(memory_gb / sides - side_gib(shape, layers, 0, fp8))
    return float(kv) if kv >= 4 else 22.0


def order(names: list[str], r: int) -> list[str]:
    """Round r's order: rotated each round, so no side always runs right after another."""
    k = r % len(names)
    return names[k:] + names[:k]


def progress(side: str, work: dict, which: str, res: dict) -> dict:
    """One line per pass as it ends, so that a run stopped early (a slow side, the device's time) still says what
    each finished pass measured."""
    tok, secs = res.get("tok_s"), res.get("seconds")
    print(f"[pass] {side} {work['label']} {which}" + (f": {tok:.0f} tok/s" if tok is not None else "")
          + (f", {secs:.1f} s" if secs is not None else ""), flush=True)
    return res


def timed_rounds(sides: dict[str, Side], works: list[dict], rounds: int, profile_tokens: int = 0) -> tuple[dict, dict]:
    """Per workload: a warm-up pass of every side (compilation and graph capture out of the timing), then
    `rounds` rounds in which every side runs one timed pass. Returns (tokens/s of each pass, and per side: what
    its patches chose at run time by its last pass (how many GEMM problems run cuBLAS, which attention launches
    stay natural) and, with profile_tokens, its kernel table over one untimed pass of that many output tokens)."""
    got = {w["label"]: {n: [] for n in sides} for w in works}
    notes = {w["label"]: {n: {} for n in sides} for w in works}
    for w in works:
        for n, s in sides.items():
            progress(n, w, "warm-up", s.run({**w, "warmup": True}))
        for r in range(rounds):
            for n in order(list(sides), r):
                res = progress(n, w, f"round {r + 1}", sides[n].run(w))
                got[w["label"]][n].append(res["tok_s"])
                notes[w["label"]][n]["patch_choices"] = res.get("patch_choices", {})
        for n, s in sides.items() if profile_tokens else ():
            notes[w["label"]][n]["kernels"] = s.run({**w, "output": min(w["output"], profile_tokens),
                                                     "profile": True})["kernels"]
    return got, notes


def measure_model(shape: Shape, layers: int, names: list[str], works: list[dict], rounds: int, kv_bytes: int,
                  memory_gb: float, model_dir: Path, common: dict | None = None, fp8: bool = False,
                  previous: str = "", profile_tokens: int = 0) -> list[dict]:
    """Every side on every workload. Sides that fit on the GPU together are resident at once and take turns,
    pass by pass; otherwise each side is a process of its own in turn (default first and last). common: LLM
    options every side gets (--fp8: the FP8 KV cache); fp8: block-FP8 weights (memory, the FP8 patches)."""
    max_len = max(w["input"] + w["output"] for w in works)
    need = side_gib(shape, layers, kv_bytes, fp8)
    hybrid = isinstance(shape, HybridShape)
    total_gib = gpu_total_gib()
    memory_gb = memory_gb or total_gib - 8
    together = len(names) * need <= memory_gb
    runners = {}  # side: the vLLM model runner its engine chose (V1 or V2: they capture graphs differently)
    if together:
        sides = {n: Side(n, model_dir, kv_bytes, max_len, need / total_gib, common, fp8, previous, hybrid)
                 for n in names}
        try:
            for n, s in sides.items():
                runners[n] = s.wait_ready().get("model_runner")
            got, notes = timed_rounds(sides, works, rounds, profile_tokens)
        finally:
            for s in sides.values():
                s.close()
    else:
        got = {w["label"]: {n: [] for n in names} for w in works}
        notes = {w["label"]: {n: {} for n in names} for w in works}
        for n in [*names, "default"]:
            one = Side(n, model_dir, kv_bytes, max_len, need / total_gib, common, fp8, previous, hybrid)
            try:
                runners[n] = one.wait_ready().get("model_runner")
                passes, seen = timed_rounds({n: one}, works, rounds, profile_tokens)
                for label in passes:
                    got[label][n].extend(passes[label][n])
                    notes[label][n].update(seen[label][n])
            finally:
                one.close()
    out = []
    for w in works:
        tok = got[w["label"]]
        base = statistics.median(tok["default"])
        for n in names[1:]:
            ratios = [v / base for v in tok[n]]
            out.append({"shape": shape.name, "layers": layers, "side": n, "workload": w["label"],
                        "requests": w["requests"], "together": together, "tok_s": {"default": tok["default"],
                                                                                 n: tok[n]},
                        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                  "all": ratios},
                        "patch_choices": notes[w["label"]][n].get("patch_choices", {}),
                        "model_runner": {m: runners.get(m) for m in ("default", n)},
                        **({"kernels": {m: notes[w["label"]][m]["kernels"] for m in ("default", n)}}
                           if profile_tokens else {})})
    return out


def short(name: str, width: int = 100) -> str:
    """A kernel name for a table cell: its start and its end (where template instantiations differ)."""
    return name if len(name) <= width else f"{name[:width - 45]}...{name[-42:]}"


def kernel_comparison(r: dict, top: int = 15) -> str:
    """A result's kernel tables side by side: the kernels that take most GPU time on either side, in ms."""
    side, k = r["side"], r["kernels"]
    ms = {n: {row["name"]: row["ms"] for row in k[n]["kernels"]} for n in ("default", side)}
    names = sorted(set(ms["default"]) | set(ms[side]), key=lambda x: -max(ms["default"].get(x, 0), ms[side].get(x, 0)))
    lines = [f"\n{r['shape']} {r['workload']}: GPU ms per kernel over one profiled pass, default vs {side} "
             f"(GPU totals {k['default']['total_ms']:.0f} / {k[side]['total_ms']:.0f} ms, wall "
             f"{k['default'].get('wall_ms', 0):.0f} / {k[side].get('wall_ms', 0):.0f} ms)",
             f"| kernel | default | {side} |", "|---|---|---|"]
    for x in names[:top]:
        cell = lambda n: f"{ms[n][x]:.1f}" if x in ms[n] else "-"  # noqa: E731
        lines.append(f"| {short(x)} | {cell('default')} | {cell(side)} |")
    for n in [n for n in ("default", side) if k[n].get("gemm_problems")]:
        lines += [f"\n{n}: GEMM problems outside CUDA graphs (op, input shapes, calls, GPU ms)",
                  "| op | shapes | calls | ms |", "|---|---|---|---|"]
        lines += [f"| {g['op']} | {g['shapes']} | {g['calls']} | {g['ms']:.1f} |"
                  for g in k[n].get("gemm_problems", [])[:top]]
    return "\n".join(lines)


def parse_workload(text: str, requests: int) -> dict:
    """`input:output` or `input:output:requests`."""
    parts = [int(x) for x in text.split(":")]
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise SystemExit(f"workload {text!r}: expected input:output or input:output:requests, positive integers")
    inp, outp = parts[:2]
    n = parts[2] if len(parts) == 3 else requests
    return {"input": inp, "output": outp, "requests": n, "seed": 0, "label": f"{inp}:{outp} x {n}"}


def linear_weights(cfg: dict) -> list[str]:
    """The names of the model's 2-D module weights (linears, routers, embeddings), from its config alone (built on
    the meta device: dummy weights have no checkpoint to read them from)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [f"{n}.weight" for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="Qwen3-8B,Qwen3-30B-A3B")
    ap.add_argument("--sides", default="consistent,batch_invariant")
    ap.add_argument("--workloads", default="512:256,256:2048:64")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gb", type=float, default=22.0,
                    help="each side's KV cache; 0: the most that lets every side be resident together (at least "
                         "4 GiB, else 22 GiB and the sides in turn)")
    ap.add_argument("--memory-gb", type=float, default=0.0, help="what the sides may use together (0: the GPU's memory less 8 GiB)")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights and an FP8 KV cache on every side")
    ap.add_argument("--previous-pythonpath", default="", help="the import path of the `previous` side's tic tree")
    ap.add_argument("--profile-tokens", type=int, default=0,
                    help="after the timed rounds, one untimed pass per side and workload under torch.profiler with "
                         "at most this many output tokens: GPU time per kernel, printed side by side (0: none)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    known = [*SIDES, "previous", "fixed-block"]
    unknown = [s for s in a.sides.split(",") if (s not in known and not s.startswith("only:")) or s == "default"]
    if unknown:
        raise SystemExit(f"unknown side {unknown[0]!r}; sides: {', '.join(n for n in known if n != 'default')}")
    if "previous" in a.sides.split(",") and not a.previous_pythonpath:
        raise SystemExit("side previous needs --previous-pythonpath")
    works = [parse_workload(w, a.requests) for w in a.workloads.split(",")]
    names = ["default", *a.sides.split(",")]
    results = []
    for shape in by_name(a.shapes.split(",")):
        layers = shape.layers
        model_dir = Path(tempfile.mkdtemp(prefix=f"tput-{shape.slug}-"))
        cfg = shape.config(layers=layers)
        if a.fp8:
            cfg["quantization_config"] = block_fp8_config((128, 128), unquantized_linears(linear_weights(cfg)))
        (model_dir / "config.json").write_text(json.dumps(cfg))
        common = {"kv_cache_dtype": "fp8"} if a.fp8 else {}
        if isinstance(shape, HybridShape):  # every side: vLLM refuses more batch slots than the cache has states
            common["max_num_seqs"] = max(w["requests"] for w in works)
        kv_gb = a.kv_gb or shared_kv_gib(shape, layers, len(names), a.memory_gb or gpu_total_gib() - 8, a.fp8)
        print(f"{shape.name}: {kv_gb:.1f} GiB of KV cache per side", flush=True)
        for res in measure_model(shape, layers, names, works, a.rounds, int(kv_gb * GiB), a.memory_gb, model_dir,
                                 common, a.fp8, a.previous_pythonpath, a.profile_tokens):
            results.append({**res, "fp8": a.fp8})
            print(json.dumps(results[-1]), flush=True)
    print("\n| model (layers) | workload | side | default tok/s | side tok/s | side / default: median (min-max) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        med = lambda v: statistics.median(v)  # noqa: E731
        q = r["ratio"]
        print(f"| {r['shape']} ({r['layers']}) | {r['workload']} | {r['side']} | "
              f"{med(r['tok_s']['default']):.0f} | {med(r['tok_s'][r['side']]):.0f} | "
              f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) |")
    for r in results:
        if "kernels" in r:
            print(kernel_comparison(r))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
