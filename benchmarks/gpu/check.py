"""Recompute C3/C4/C5 from the saved raw records, independently of tic's metrics, and compare with the ladder.

  python benchmarks/gpu/check.py RESULTS_DIR [NAME ...]

Reads RESULTS_DIR/records/<name>-vllm.jsonl (vLLM outputs exactly as reported), RESULTS_DIR/<name>-train.jsonl
(HF train-side logprobs) and RESULTS_DIR/<name>-ladder.json; prints one table row per config and exits 1 if a
recomputed figure disagrees with the ladder's. Only the standard library: bit equality via struct.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def lp_of(pos: dict, tok: int) -> float:
    return pos[str(tok)]


def recompute(d: Path, name: str, c3_limit: int | None = None) -> dict:
    """c3_limit: how many probe comparisons C3 made; the locator reruns a C3 layout after the gate, and those
    later records (same kind) are not part of the gate's figure."""
    recs = [json.loads(l) for l in (d / "records" / f"{name}-vllm.jsonl").read_text().splitlines()]
    gen = [r for r in recs if r["kind"] == "generate"]
    n = len(gen)
    sampled = {r["request_id"]: [lp_of(p, t) for p, t in zip(r["logprobs"], r["token_ids"])] for r in gen}
    # C3: probe alone (a call of one) vs the probe inside each later batch
    alone, c3_cmp, c3_eq, c3_ident, c3_n = {}, 0, 0, 0, 0
    for r in recs:
        if r["kind"] != "together" or (c3_limit is not None and c3_n >= c3_limit):
            continue
        if r["batch"] == 1:
            alone[r["request_id"]] = r
            continue
        if r["request_id"] >= n:  # a batch-mate (its own seed), not the probe
            continue
        a = alone[r["request_id"]]
        ta, tb = a["token_ids"], r["token_ids"]
        la = [lp_of(p, t) for p, t in zip(a["logprobs"], ta)]
        lb = [lp_of(p, t) for p, t in zip(r["logprobs"], tb)]
        m = min(len(ta), len(tb))
        div = next((i for i in range(m) if ta[i] != tb[i]), None)
        k = m if div is None else div + 1
        eq = sum(1 for i in range(k) if ta[i] == tb[i] and bits(la[i]) == bits(lb[i]))
        c3_cmp += k
        c3_eq += eq
        c3_n += 1
        c3_ident += int(eq == k and len(ta) == len(tb))
    # C4: decode logprobs vs prompt_logprobs of the whole sequence
    scored = {}
    for r in recs:
        if r["kind"] == "score" and r["request_id"] not in scored:
            P = len(r["prompt_token_ids"]) - len(sampled[r["request_id"]])
            ids = r["prompt_token_ids"]
            scored[r["request_id"]] = [lp_of(r["prompt_logprobs"][i], ids[i]) for i in range(P, len(ids))]
    c4_tok = sum(len(v) for v in sampled.values())
    c4_eq = sum(bits(a) == bits(b) for rid in sampled for a, b in zip(sampled[rid], scored.get(rid, [])))
    # C5: decode logprobs vs HF train recompute (in rollout order)
    tf = d / f"{name}-train.jsonl"
    train = [json.loads(l) for l in tf.read_text().splitlines()] if tf.is_file() else []
    by_seq = {}
    for t in train:
        by_seq.setdefault((tuple(t["prompt_token_ids"]), tuple(t["token_ids"])), t["logprobs"])
    c5_eq = 0
    for r in gen:
        tl = by_seq.get((tuple(r["prompt_token_ids"]), tuple(r["token_ids"])), [])
        c5_eq += sum(bits(a) == bits(b) for a, b in zip(sampled[r["request_id"]], tl))
    return {"C3": (c3_eq, c3_cmp, c3_ident, c3_n), "C4": (c4_eq, c4_tok), "C5": (c5_eq, c4_tok)}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python check.py RESULTS_DIR [NAME ...]", file=sys.stderr)
        return 0 if len(sys.argv) > 1 else 2
    if not Path(sys.argv[1]).is_dir():
        print(f"check.py: not a folder: {sys.argv[1]}", file=sys.stderr)
        return 2
    d = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.name[:-len("-ladder.json")] for p in d.glob("*-ladder.json"))
    bad = 0
    print("| config | C3 equal tokens (identical layouts) | C4 decode = prefill | C5 vLLM = HF | agrees with ladder |")
    print("|---|---|---|---|---|")
    for name in names:
        lad = {r["gate"]: r["metrics"] for r in json.loads((d / f"{name}-ladder.json").read_text())["results"]
               if r["verdict"] in ("pass", "fail")}  # an errored gate measured nothing
        x = recompute(d, name, lad.get("C3", {}).get("comparisons"))
        # a run cut short has no record of its later gates: those cells say so and are not checked
        ok = "C3" not in lad or (lad["C3"]["equal_tokens"], lad["C3"]["compared_tokens"],
                                 lad["C3"]["identical_requests"], lad["C3"]["comparisons"]) == x["C3"]
        ok &= all((lad[g]["equal_tokens"], lad[g]["tokens"]) == x[g] for g in ("C4", "C5") if g in lad)
        bad += not ok
        e3, c3, i3, n3 = x["C3"]
        cells = [f"{e3}/{c3} = {100 * e3 / max(c3, 1):.1f}% ({i3}/{n3})" if "C3" in lad else "not run"]
        cells += [f"{x[g][0]}/{x[g][1]} = {100 * x[g][0] / x[g][1]:.1f}%" if g in lad else "not run"
                  for g in ("C4", "C5")]
        print(f"| {name} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
