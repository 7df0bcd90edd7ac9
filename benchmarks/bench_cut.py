"""Benchmark `tic cut` on a multi-GB generated checkpoint: peak RSS and throughput.

The checkpoint is written tensor by tensor from a reused random block (never the whole model in memory). A cut
is two steps, each measured in its own child process so its peak RSS (ru_maxrss) is its own: the plan (the
config built on the meta device with transformers, layers chosen, the rewrite proven; its cost is torch +
transformers and does not grow with the checkpoint) and the copy of the kept bytes from that plan. Baseline:
reading exactly the kept byte ranges from the same shards with the same page-cache state. Targets (issue 3),
on the copy: peak RSS < 2 x largest tensor; copy time within 80 % of the read time (read_s / cut_s >= 0.8).

    .venv/bin/python benchmarks/bench_cut.py [--gib 2.5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER, VOCAB, SHARD_LAYERS = 2048, 5632, 8192, 4


def write_checkpoint(d: Path, n_layers: int) -> int:
    """Llama-shaped float32 checkpoint in shards of SHARD_LAYERS layers; returns the largest tensor's bytes."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": n_layers, "num_attention_heads": 16,
           "num_key_value_heads": 16, "vocab_size": VOCAB, "dtype": "float32", "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg))
    per_layer = [("self_attn.q_proj.weight", [HIDDEN, HIDDEN]), ("self_attn.k_proj.weight", [HIDDEN, HIDDEN]),
                 ("self_attn.v_proj.weight", [HIDDEN, HIDDEN]), ("self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
                 ("mlp.gate_proj.weight", [INTER, HIDDEN]), ("mlp.up_proj.weight", [INTER, HIDDEN]),
                 ("mlp.down_proj.weight", [HIDDEN, INTER]), ("input_layernorm.weight", [HIDDEN]),
                 ("post_attention_layernorm.weight", [HIDDEN])]
    groups = [[("model.embed_tokens.weight", [VOCAB, HIDDEN])]]
    for s in range(0, n_layers, SHARD_LAYERS):
        groups.append([(f"model.layers.{i}.{n}", sh) for i in range(s, min(s + SHARD_LAYERS, n_layers))
                       for n, sh in per_layer])
    groups[-1] += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    block = os.urandom(16 << 20)
    weight_map, largest = {}, 0
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in group:
            nbytes = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + nbytes]}
            off += nbytes
            largest = max(largest, nbytes)
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with (d / fname).open("wb") as f:
            f.write(len(hb).to_bytes(8, "little") + hb)
            left = off
            while left:  # the same random block again and again: the cut cannot tell, and RAM stays small
                step = min(left, len(block))
                f.write(memoryview(block)[:step])
                left -= step
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return largest


PLAN_CHILD = """
import json, resource, sys, time
from pathlib import Path
t = time.perf_counter()
from tic.harness.model.cut import plan_cut
plan = plan_cut(Path(sys.argv[1]), layers=sys.argv[3])
Path(sys.argv[2]).write_text(json.dumps(plan))
print(json.dumps({"plan_s": time.perf_counter() - t, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""
CHILD = """
import json, resource, sys, time
from pathlib import Path
from tic.harness.model.cut import write_cut
plan = json.loads(Path(sys.argv[3]).read_text())
t = time.perf_counter()
rec = write_cut(Path(sys.argv[1]), Path(sys.argv[2]), plan, fsync=sys.argv[4] == "1")
print(json.dumps({"cut_s": time.perf_counter() - t, "layers": rec["layers"], "bytes_kept": rec["bytes_kept"],
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "torch_imported": "torch" in sys.modules}))
"""


def read_kept(model_dir: Path, cut_dir: Path) -> float:
    """Seconds to read the kept tensors' byte ranges from the source shards (1 MiB-chunk readinto)."""
    from tic.harness.model.inventory import tensor_locations

    rec = json.loads((cut_dir / "cut.json").read_text())
    kept = set(rec["layers"])
    locs = tensor_locations(model_dir)
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    for name, loc in sorted(locs.items(), key=lambda kv: (str(kv[1]["path"]), kv[1]["start"])):
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) not in kept:
            continue
        with open(loc["path"], "rb", buffering=0) as f:
            f.seek(loc["start"])
            left = loc["end"] - loc["start"]
            while left:
                k = f.readinto(memoryview(buf)[:min(left, len(buf))])
                left -= k
    return time.perf_counter() - t


def drop_page_cache() -> bool:
    """Cold-cache timing where allowed (root): both the baseline and the cut then read from the disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure(src: Path, root: Path, repeat: int) -> dict:
    """The plan once, a warm-up cut, then `repeat` rounds of: the read baseline and the three cuts (default, one
    copy at a time, --fsync) one after the other, page cache dropped before each and dirty pages written back
    (sync) so that no timing pays for the previous one's writeback."""
    env = dict(os.environ)
    plan_path = root / "plan.json"
    r = subprocess.run([sys.executable, "-c", PLAN_CHILD, str(src), str(plan_path), "auto"], check=True,
                       capture_output=True, text=True, env=env)
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    subprocess.run([sys.executable, "-c", CHILD, str(src), str(root / "warm"), str(plan_path), "1"], check=True,
                   capture_output=True, env=env)

    def cut(dest: str, fsync: bool, threads: str | None = None) -> dict:
        shutil.rmtree(root / dest, ignore_errors=True)
        os.sync()
        drop_page_cache()
        e = env if threads is None else {**env, "TIC_CUT_THREADS": threads}
        r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(root / dest), str(plan_path),
                            "1" if fsync else "0"],
                           check=True, capture_output=True, text=True, env=e)
        return json.loads(r.stdout.strip().splitlines()[-1])

    rounds, cold = [], False
    for _ in range(repeat):
        os.sync()
        cold = drop_page_cache()
        read_s = read_kept(src, root / "warm")
        rounds.append({"read": read_s, "cut": cut("cut", False), "synced": cut("synced", True),
                       "serial": cut("serial", False, "1")})
    return {"plan": plan, "rounds": rounds, "cold": cold}


def report(measured: dict, total: int, n_layers: int, gen_s: float, largest: int) -> tuple[list, bool]:
    """The table's rows (medians over the rounds) and whether both targets are met."""
    rounds, plan_m = measured["rounds"], measured["plan"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    read_s = med([x["read"] for x in rounds])
    m = dict(rounds[0]["cut"], cut_s=med([x["cut"]["cut_s"] for x in rounds]),
             maxrss_kib=max(x["cut"]["maxrss_kib"] for x in rounds))
    m1 = {"cut_s": med([x["synced"]["cut_s"] for x in rounds])}
    m2 = {"cut_s": med([x["serial"]["cut_s"] for x in rounds])}
    per_round = ", ".join(f"{x['read'] / x['cut']['cut_s']:.2f}" for x in rounds)
    per_round_serial = ", ".join(f"{x['read'] / x['serial']['cut_s']:.2f}" for x in rounds)
    rss = m["maxrss_kib"] * 1024
    rows = [
        ("checkpoint", f"{total / 2**30:.2f} GiB, {n_layers} layers (written in {gen_s:.1f} s)"),
        ("kept layers", f"{m['layers']}"),
        ("bytes kept", f"{m['bytes_kept'] / 2**20:.0f} MiB"),
        ("largest tensor", f"{largest / 2**20:.1f} MiB"),
        ("plan (meta build, choice, proof)", f"{plan_m['plan_s']:.2f} s, peak RSS {plan_m['maxrss_kib'] / 2**10:.0f} MiB "
                                             "(torch + transformers; once per cut, not per byte)"),
        ("peak RSS of the copy", f"{rss / 2**20:.1f} MiB  ({rss / largest:.2f} x largest tensor; target < 2; "
                                 f"torch imported: {m['torch_imported']})"),
        ("page cache", "dropped before each timing (cold reads)" if measured["cold"] else "warm (no root to drop it)"),
        ("rounds", f"{len(rounds)} (medians below)"),
        ("time: read kept bytes", f"{read_s:.2f} s  ({m['bytes_kept'] / read_s / 2**20:.0f} MiB/s)"),
        (f"time: copy (default, {os.environ.get('TIC_CUT_THREADS', '8')} copies in flight)",
         f"{m['cut_s']:.2f} s  ({m['bytes_kept'] / m['cut_s'] / 2**20:.0f} MiB/s)"),
        ("read_s / cut_s", f"{read_s / m['cut_s']:.2f}  (target >= 0.80; per round: {per_round})"),
        ("time: copy, 1 at a time",
         f"{m2['cut_s']:.2f} s  (read_s / cut_s = {read_s / m2['cut_s']:.2f}; per round: {per_round_serial})"),
        ("time: copy --fsync", f"{m1['cut_s']:.2f} s  (read_s / cut_s = {read_s / m1['cut_s']:.2f}; "
                                   "bounded by the disk's write speed)"),
    ]
    return rows, (rss < 2 * largest, read_s / m["cut_s"] >= 0.8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeat", type=int, default=5, help="measured rounds (medians reported)")
    a = ap.parse_args()
    per_layer_bytes = 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN)
    n_layers = max(8, int((a.gib * (1 << 30) - 2 * 4 * VOCAB * HIDDEN) // per_layer_bytes))
    root = Path(tempfile.mkdtemp(prefix="tic-bench-cut-", dir=a.dir))
    try:
        src = root / "full"
        src.mkdir()
        t = time.perf_counter()
        largest = write_checkpoint(src, n_layers)
        gen_s = time.perf_counter() - t
        total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        rows, (rss_ok, time_ok) = report(measure(src, root, a.repeat), total, n_layers, gen_s, largest)
        w = max(len(k) for k, _ in rows)
        print("| " + "what".ljust(w) + " | value |\n|" + "-" * (w + 2) + "|-------|")
        for k, v in rows:
            print(f"| {k.ljust(w)} | {v} |")
        print(f"\nRSS target {'met' if rss_ok else 'MISSED'}; time target {'met' if time_ok else 'MISSED'}")
        sys.exit(0 if rss_ok and time_ok else 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
