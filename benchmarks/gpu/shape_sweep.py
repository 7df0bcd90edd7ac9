"""C0 and C3-C7 (C8 for the Megatron trainer) on 4-layer cuts with the layer shapes of public models
(benchmarks/gpu/shapes.py), on one GPU.

  python benchmarks/gpu/shape_sweep.py run WORK OUT [--shapes A,B] [--modes eager,graph] [--variants patched]
                                           [--first SHAPE:MODE:VARIANT,...]
                                           [--requests 64] [--max-prompt 4096] [--tokens 512] [--parallel 6]
                                           [--memory-gb GPU-8] [--timeout 3000] [--previous-pythonpath P]
  python benchmarks/gpu/shape_sweep.py table OUT          # the table again, from OUT's records

Each (shape, rollout mode, variant) is one tic.yaml under WORK, run by run_gates.py in a process of its own:
- the rollout: vLLM (default scheduler, chunked prefill on), 64 requests, prompts of 16 up to 4096 tokens (or
  the model's context less the sampled tokens), 512 sampled tokens each at temperature 1;
- the training side: transformers on vLLM's kernels (train: {kernels: vllm});
- modes: eager (enforce_eager), graph (CUDA graphs of the decode steps, compilation mode 0 / FULL_DECODE_ONLY),
  compiled (vLLM's default mode 3 / FULL_AND_PIECEWISE with its CUDA kernels kept: custom_ops [all], vllm_c norms);
- variants: patched (rollout.patches: tic's three vLLM patches), stock (none), no-gemm (the patches less the dense
  GEMM one: its with/without run), fixed-block (the patches with rmsnorm-fixed-block for rmsnorm-rows: the two
  norm fixes' A/B), no-norm (the patches less the norm one: the with/without run of either norm patch), previous
  (the patched config run on another tic tree, --previous-pythonpath, e.g. the release before a patch change: its
  with/without run), fp8 (block-FP8 weights 128 x 128 quantized from the seeded ones, an FP8 KV cache on both sides,
  the patches plus the FP8 ones), fp8-no-moecfg (fp8 less moe-fixed-config: its with/without run), megatron (the
  patched rollout against tic's Megatron-core trainer, train: {engine: megatron}; eager also runs C8; needs
  megatron-core, device_env.sh's megatron_install), v1-runner and v1-runner-no-norm (patched and no-norm on vLLM's
  V1 model runner; the other variants run the runner vLLM picks, V2 for dense models, as users and
  rollout_throughput.py run it).
Eager runs C0, C3-C7 (megatron C0, C3-C8); the CUDA-graph modes run C0, C3-C5 (C6 and C7 compare the training
side with itself and are the eager run's). Runs share the GPU: a run starts when its estimated memory fits beside
the running ones.
Weights are generated once per shape (seeded, tic's model cache) and removed when the shape's runs are done.
Writes OUT/<run>.json (the gate records), OUT/<run>.log, OUT/table.md, OUT/sweep.json; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from configs import (FP8_PATCHES, NORM_PATCHES, PATCHES as TIC_PATCHES, TRAIN, tic_yaml,  # noqa: E402
                     use_block_fp8, with_norm)
from shapes import Shape, by_name  # noqa: E402

PATCHES = list(TIC_PATCHES)
# the sweep's modes: graph = CUDA graphs of the decode steps without torch.compile; compiled = vLLM's default
# compilation with its CUDA kernels kept
MODES = {"eager": "eager", "graph": "decode-graphs", "compiled": "compiled"}
VARIANTS = ("patched", "stock", "no-gemm", "fixed-block", "no-norm", "previous", "fp8", "fp8-no-moecfg", "megatron",
            "v1-runner", "v1-runner-no-norm")
ROLLOUT_GATES = "C0,C3,C4,C5"
ALL_GATES = "C0,C3,C4,C5,C6,C7"
# the Megatron trainer also runs C8: its weight sync into vLLM is part of what it adds
MEGATRON_GATES = ALL_GATES + ",C8"
GATE_COLUMNS = ("C0", "C3", "C4", "C5", "C6", "C7", "C8")
GiB = 1 << 30


@dataclass
class Run:
    shape: Shape
    mode: str
    variant: str
    config: Path
    gates: str
    memory: float  # estimated peak GiB on the GPU
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def name(self) -> str:
        return self.config.stem


def kv_bytes_per_token(s: Shape, layers: int = 4) -> int:
    return layers * 2 * s.kv_heads * s.head_dim * 2


def workload(s: Shape, requests: int, max_prompt: int, tokens: int) -> dict:
    top = min(max_prompt, s.max_positions - tokens)
    return {"requests": requests, "min_len": 16, "max_len": top, "tokens": tokens, "model_len": top + tokens}


def estimate_gib(s: Shape, mode: str, w: dict) -> float:
    """Peak GPU memory of one run: vLLM's weights and KV cache, the training model, then the larger of what later
    gates add (the caching allocator reuses one gate's blocks for the next): C5's float32 log-softmax over one
    micro-batch at the longest sequence (about 10 GiB at a 150k vocabulary), or the eager run's C7 float32
    reference with its gradients and eager attention over the longest sequence."""
    p = s.params()
    kv = w["requests"] * w["model_len"] * kv_bytes_per_token(s)
    logits = TRAIN["vllm"]["micro_batch_size"] * w["model_len"] * s.vocab * 4
    extra = logits
    if mode == "eager":
        attn = 2 * s.heads * w["model_len"] ** 2 * 4 * 4  # probs and scores per layer, 4 layers, float32
        extra = max(extra, 8 * p + attn)
    est = 2 * p + 1.2 * kv + 4 * p + extra + 6 * GiB
    return est / GiB


def run_config(s: Shape, mode: str, variant: str, w: dict, model_dir: Path) -> dict:
    kv = w["requests"] * w["model_len"] * kv_bytes_per_token(s)
    options = {"max_model_len": w["model_len"], "kv_cache_memory_bytes": int(1.2 * kv) + (256 << 20),
               "gpu_memory_utilization": round(min(0.9, (2 * s.params() + 1.2 * kv + 3 * GiB) / (140 * GiB)), 3)}
    patches = {"stock": (), "fp8": FP8_PATCHES,
               "fp8-no-moecfg": tuple(p for p in FP8_PATCHES if p != "moe-fixed-config"),
               "no-gemm": tuple(p for p in PATCHES if not p.startswith("gemm-")),
               "fixed-block": with_norm(PATCHES, "rmsnorm-fixed-block"),
               "no-norm": tuple(p for p in PATCHES if p not in NORM_PATCHES),
               "v1-runner-no-norm": tuple(p for p in PATCHES if p not in NORM_PATCHES),
               }.get(variant, PATCHES)
    if variant.startswith("v1-runner"):
        options["model_runner"] = "v1"
    cfg = tic_yaml(f"{s.slug}-{mode}-{variant}", model_dir, MODES[mode], patches,
                   requests=w["requests"], min_len=w["min_len"], max_len=w["max_len"], tokens=w["tokens"],
                   options=options, train="megatron" if variant == "megatron" else "vllm")
    if variant.startswith("fp8"):
        use_block_fp8(cfg)
    return cfg


def plan(args) -> tuple[list[Run], dict[str, dict]]:
    """The runs, shape by shape (a shape's weights are on disk from its first run to its last): --first's runs
    (shape:mode:variant, comma-separated) lead, then every shape x mode x variant."""
    work = Path(args.work).resolve()
    loads: dict[str, dict] = {}
    wanted = [tuple(x.split(":")) for x in (getattr(args, "first", "") or "").split(",") if x]
    wanted += [(s.name, m, v) for s in by_name(args.shapes.split(",") if args.shapes else None)
               for m in args.modes.split(",") for v in args.variants.split(",")]
    order = list(dict.fromkeys(w[0] for w in wanted))
    wanted = sorted(dict.fromkeys(wanted), key=lambda w: order.index(w[0]))  # stable: --first leads its shape
    runs = []
    for name, mode, variant in wanted:
        if mode not in MODES or variant not in VARIANTS:
            raise SystemExit(f"unknown mode or variant in {name}:{mode}:{variant} (modes {', '.join(MODES)}; "
                             f"variants {', '.join(VARIANTS)})")
        (s,) = by_name([name])
        w = loads.setdefault(s.name, workload(s, args.requests, args.max_prompt, args.tokens))
        model_dir = work / "models" / s.slug
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(s.config(), indent=1))
        cfg = work / f"{s.slug}-{mode}-{variant}.yaml"
        cfg.write_text(yaml.safe_dump(run_config(s, mode, variant, w, model_dir), sort_keys=False))
        gates = ROLLOUT_GATES if mode != "eager" else MEGATRON_GATES if variant == "megatron" else ALL_GATES
        gates = only_gates(gates, getattr(args, "gates", ""))
        runs.append(Run(s, mode, variant, cfg, gates,
                        estimate_gib(s, mode, w)))
    return runs, loads


def only_gates(gates: str, wanted: str) -> str:
    """The run's own gates that `wanted` names, C0 always first: it refuses a mode before any engine starts."""
    if not wanted:
        return gates
    names = {g.strip() for g in wanted.split(",") if g.strip()}
    unknown = names - set(GATE_COLUMNS)
    if unknown:
        raise SystemExit(f"unknown gates {', '.join(sorted(unknown))} (known: {', '.join(GATE_COLUMNS)})")
    return ",".join(g for g in gates.split(",") if g == "C0" or g in names)


class Weights:
    """Generates each shape's weights ahead of its runs, in run order, with at most `keep` shapes on disk, and
    removes a shape's weights once its runs are done."""

    def __init__(self, shapes: list[Shape], work: Path, keep: int = 3):
        self.dirs: dict[str, Path | BaseException] = {}
        self.on_disk: set[str] = set()
        self.work, self.keep = work, keep
        self.thread = threading.Thread(target=self._generate, args=(shapes,), daemon=True)
        self.thread.start()

    def _generate(self, shapes):
        from tic.harness.model.generate import generate_model

        for s in shapes:
            while len(self.on_disk) >= self.keep:
                time.sleep(2)
            self.on_disk.add(s.name)
            try:
                self.dirs[s.name] = generate_model(self.work / "models" / s.slug, 0)
            except BaseException as e:  # noqa: BLE001 - the shape's runs report it
                self.dirs[s.name] = e

    def ready(self, s: Shape) -> bool:
        return s.name in self.dirs

    def release(self, s: Shape) -> None:
        d = self.dirs.get(s.name)
        if isinstance(d, Path):
            shutil.rmtree(d, ignore_errors=True)
        self.on_disk.discard(s.name)


def _gpu_gib(field: str) -> float:
    """nvidia-smi's memory.FIELD of the first GPU, in GiB (inf where it cannot be read)."""
    try:
        got = subprocess.run(["nvidia-smi", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return float(got[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return float("inf")


def free_gib() -> float:
    """Free memory on the GPU now, in GiB."""
    return _gpu_gib("free")


def execute(args) -> None:
    runs, loads = plan(args)
    if not args.memory_gb:  # the card's memory less room for the allocators beside the estimates
        args.memory_gb = _gpu_gib("total") - 8
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    shapes = list({r.shape.name: r.shape for r in runs}.values())
    weights = Weights(shapes, work)
    pending, running, done = list(runs), [], []
    t0 = time.time()
    while pending or running:
        for r in [r for r in running if r.proc.poll() is not None or time.time() - r.started > args.timeout]:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
                with open(out / f"{r.name}.log", "a") as f:
                    f.write(f"\n[sweep] killed after {args.timeout} s\n")
            running.remove(r)
            done.append(r)
            print(f"[sweep] {time.time() - t0:6.0f} s  done {r.name} (exit {r.proc.returncode})", flush=True)
            if not any(x.shape is r.shape for x in pending + running):
                weights.release(r.shape)
        used = sum(r.memory for r in running)
        for r in list(pending):
            if len(running) >= args.parallel or not weights.ready(r.shape):
                break  # runs start in order: a shape's weights come one after another
            if running and (used + r.memory > args.memory_gb or free_gib() < r.memory
                            or time.time() - max(x.started for x in running) < args.stagger):
                break  # estimates are estimates: what is free now decides too, once the last start settled
            pending.remove(r)
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
            if r.variant == "previous":
                env["PYTHONPATH"] = args.previous_pythonpath
            log = open(out / f"{r.name}.log", "w")
            r.proc = subprocess.Popen([sys.executable, str(HERE / "run_gates.py"), str(r.config), str(out / f"{r.name}.json"),
                                       "--gates", r.gates], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
            r.started = time.time()
            running.append(r)
            used += r.memory
            print(f"[sweep] {time.time() - t0:6.0f} s  start {r.name} (~{r.memory:.0f} GiB, {used:.0f} in use)",
                  flush=True)
        time.sleep(2)
    summary = {"workloads": loads, "runs": [{"name": r.name, "shape": r.shape.name, "mode": r.mode,
                                             "variant": r.variant, "exit": r.proc.returncode,
                                             "seconds": round(time.time() - r.started)} for r in done]}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    print(render(out))


# -- the table ----------------------------------------------------------------------------------------------
def _cell(rec: dict | None) -> str:
    if rec is None:
        return "not run"
    v, m = rec["verdict"], rec.get("metrics") or {}
    if rec["gate"] == "C0":
        return v if v == "pass" else f"**refused**: {rec.get('reason', '')[:160]}"
    if v == "error":
        return f"**error**: {rec.get('reason', '')[:100]}"
    if rec["gate"] == "C7":
        text = v
        if isinstance(m.get("min_cosine"), (int, float)):
            text += (f" {m.get('tensors')} tensors, min cos {m['min_cosine']:.4f}, "
                     f"max rel {m.get('max_rel_error', float('nan')):.3f}")
        return text if v == "pass" else f"**{text}**"
    frac = m.get("equal_fraction")
    text = f"{v} {100 * frac:.1f} %" if isinstance(frac, (int, float)) else v
    if isinstance(m.get("max"), (int, float)):
        text += f", max \\|Δp\\| {m['max']:.3g}"
    if rec["gate"] == "C6" and "identical_layouts" in m:
        text += f" ({m['identical_layouts']}/{m['layouts']} layouts)"
    return text if v == "pass" else f"**{text}**"


def _located(rec: dict) -> str:
    loc = (rec.get("details") or {}).get("locate") or {}
    if not loc:
        return ""
    if loc.get("first_divergent_layer") is None and loc.get("status"):
        return f"{rec['gate']}: {loc['status']}"  # the locator did not run (or found nothing): why, in its words
    rep = loc.get("repro_check") or {}
    repro = "repro exits 1" if rep.get("reproduces") else "no repro"
    return (f"{rec['gate']}: layer {loc.get('first_divergent_layer')}, {loc.get('culprit_module')}, "
            f"{loc.get('first_operator')} ({repro})")


def describe(name: str) -> dict:
    """shape, mode and variant of a run from its name (<shape slug>-<mode>-<variant>)."""
    from shapes import SHAPES

    for sh in SHAPES:
        for mode in MODES:
            for variant in VARIANTS:
                if name == f"{sh.slug}-{mode}-{variant}":
                    return {"shape": sh.name, "mode": mode, "variant": variant}
    return {"shape": name, "mode": "", "variant": ""}


def render(out: Path) -> str:
    summary = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").is_file() else {"runs": []}
    names = [r["name"] for r in summary["runs"]] or sorted(p.stem for p in out.glob("*.json") if p.stem != "sweep")
    lines = ["| shape | mode | variant | " + " | ".join(GATE_COLUMNS) + " | locator on the first failure |",
             "|---|---|---|" + "---|" * len(GATE_COLUMNS) + "---|"]
    meta = {r["name"]: r for r in summary["runs"]}
    for name in names:
        p = out / f"{name}.json"
        recs = {r["gate"]: r for r in json.loads(p.read_text())["results"]} if p.is_file() else {}
        info = meta.get(name) or describe(name)
        cells = []
        for g in GATE_COLUMNS:
            if g in ("C6", "C7") and info.get("mode") not in ("eager", ""):
                cells.append("(eager row)")
            else:
                cells.append(_cell(recs.get(g)))
        first = next((_located(recs[g]) for g in ("C3", "C4", "C5") if g in recs and _located(recs[g])), "")
        if not recs and info.get("exit") not in (None, 0):
            first = f"run ended with exit {info['exit']} before any gate (see {name}.log)"
        lines.append(f"| {info['shape']} | {info['mode']} | {info['variant']} | " + " | ".join(cells) + f" | {first} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("work")
    r.add_argument("out")
    r.add_argument("--shapes", default="")
    r.add_argument("--modes", default="eager,graph")
    r.add_argument("--variants", default="patched")
    r.add_argument("--first", default="", help="runs to start first, as shape:mode:variant,...")
    r.add_argument("--requests", type=int, default=64)
    r.add_argument("--max-prompt", type=int, default=4096)
    r.add_argument("--tokens", type=int, default=512)
    r.add_argument("--parallel", type=int, default=6)
    r.add_argument("--memory-gb", type=float, default=0.0,
                   help="the runs' estimated peaks together, at most (0: the GPU's memory less 8 GiB)")
    r.add_argument("--timeout", type=float, default=3000.0)
    r.add_argument("--stagger", type=float, default=60.0, help="seconds between run starts (memory settles)")
    r.add_argument("--previous-pythonpath", default="")
    r.add_argument("--gates", default="", help="only these of each run's gates, e.g. C7,C8 (C0 always runs)")
    t = sub.add_parser("table")
    t.add_argument("out")
    a = ap.parse_args()
    if a.cmd == "run":
        if "previous" in a.variants + a.first and not a.previous_pythonpath:
            raise SystemExit("--variants previous needs --previous-pythonpath")
        execute(a)
    else:
        print(render(Path(a.out)))


if __name__ == "__main__":
    main()
