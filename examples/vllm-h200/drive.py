"""Run one ladder config on the GPU and keep everything needed to check it offline.

  python examples/vllm-h200/drive.py CONFIG.yaml OUTDIR [--from C0 --to C5]

Writes OUTDIR/<name>-ladder.json (the ladder's JSON record, as `tic ladder --json` prints it),
OUTDIR/<name>-train.jsonl (every HF train-side score: ids and logprobs), the vLLM engine's own raw records
(rollout.options.record) and OUTDIR/<name>-capture.json: for each failing C3/C4/C5, the first layer whose
captured state differs (vLLM in-process capture vs itself or vs HF), run twice to show it reproduces.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import tic
from tic.harness.engines.base import Sample
from tic.harness.engines.hf import HFEngine
from tic.skill.config import load_config
from tic.skill.context import GateContext
from tic.skill.runner import run_ladder
from tic.skill.state import atomic_write_text

cfg_path, out = Path(sys.argv[1]), Path(sys.argv[2])
start = sys.argv[sys.argv.index("--from") + 1] if "--from" in sys.argv else "C0"
stop = sys.argv[sys.argv.index("--to") + 1] if "--to" in sys.argv else "C5"
name = cfg_path.stem
out.mkdir(parents=True, exist_ok=True)
train_log = out / f"{name}-train.jsonl"
_lines: list[str] = []
_score = HFEngine.score


def recording_score(self, samples, sampling):
    res = _score(self, samples, sampling)
    for s, t in zip(samples, res):
        _lines.append(json.dumps({"prompt_token_ids": s.prompt_ids, "token_ids": s.response_ids,
                                  "logprobs": t.double().tolist()}) + "\n")
    atomic_write_text(train_log, "".join(_lines))
    return res


HFEngine.score = recording_score

cfg = load_config(cfg_path)
if os.environ.get("TIC_LOCATE", "1") == "0":  # the shared locator off: this script localises itself below
    cfg.locate.enabled = False
ctx = GateContext(cfg)
t0 = time.time()
results = run_ladder(ctx, start, stop, keep_going=True,
                     on_result=lambda r: print(f"[{name}] {r.gate:<4} {r.verdict:<11} {r.key_figure}", flush=True))
atomic_write_text(out / f"{name}-ladder.json", json.dumps(
    {"tic_version": tic.__version__, "config": name, "results": [r.model_dump(mode="json") for r in results]},
    indent=1))
print(f"[{name}] ladder done in {time.time() - t0:.0f}s", flush=True)

# -- capture-based localisation (vLLM in-process hooks; HF hooks on the train model) ---------------------------
KEYS_ORDER = lambda keys: sorted(keys, key=lambda k: (k != "embed", k == "norm", int(k.split(".")[1]) if "." in k else 0))


def first_diff(a: dict, b: dict, upto: int) -> dict | None:
    for k in KEYS_ORDER([k for k in a if k != "positions" and k in b]):
        x, y = a[k][:upto], b[k][:upto]
        n = min(len(x), len(y))
        x, y = x[:n], y[:n]
        if not torch.equal(x, y):
            rows = (x != y).any(dim=-1).nonzero().flatten()
            p = int(rows[0])
            return {"key": k, "position": p, "differing_positions": int(rows.numel()), "of": n,
                    "max_abs": float((x.float() - y.float()).abs().max())}
    return None


def hf_capture(eng: HFEngine, seqs: list[list[int]], b: int) -> dict:
    m = eng.model
    caps: dict = {}
    hooks = [m.model.embed_tokens.register_forward_hook(lambda mod, a, o: caps.__setitem__("embed", o)),
             m.model.norm.register_forward_hook(lambda mod, a, o: caps.__setitem__("norm", o))]
    for i, layer in enumerate(m.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, a, o, i=i: caps.__setitem__(f"layers.{i}", o[0] if isinstance(o, tuple) else o)))
    try:
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s)
            mask[j, :len(s)] = 1
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        with torch.inference_mode():
            m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: v[b, :len(seqs[b])].detach().cpu() for k, v in caps.items()}


def locate(gate: str, res) -> dict | None:
    eng = ctx.rollout_engine()
    sp = ctx.sampling
    prompts = ctx.prompts
    f = res.metrics.get("first_mismatch") or {}
    if gate == "C3":
        p, size, at = f["probe"], f["batch_size"], f["index_in_batch"]
        others = [i for i in range(len(prompts)) if i != p]
        mates = [others[k % len(others)] for k in range(size - 1)]
        bp = [prompts[i] for i in mates]
        bid = [len(prompts) + 1000 * (k + 1) + i for k, i in enumerate(mates)]
        bp.insert(at, prompts[p]); bid.insert(at, p)
        upto = len(prompts[p]) + f["position"] + 1
        run = lambda: first_diff(eng.capture([prompts[p]], sp, [p], 0), eng.capture(bp, sp, bid, at), upto)
        what = {"alone": [p], "batch": bid, "probe_index": at}
    elif gate == "C4":
        s = f["sequence"]
        samples = ctx.rollout_samples()
        c0 = (s // eng.batch_size) * eng.batch_size
        chunk = list(range(c0, min(c0 + eng.batch_size, len(samples))))
        upto = len(samples[s].prompt_ids) + f["position"] + 1
        run = lambda: first_diff(eng.capture([prompts[i] for i in chunk], sp, chunk, s - c0),
                                 eng.capture([samples[i].ids for i in chunk], None, chunk, s - c0, score=True),
                                 upto)
        what = {"decode_batch": chunk, "prefill_batch": chunk, "sequence": s}
    else:
        s = f["sequence"]
        samples = ctx.rollout_samples()
        tr = ctx.train_engine()
        mb = tr.micro_batch_size
        c0 = (s // mb) * mb
        tchunk = [samples[i].ids for i in range(c0, min(c0 + mb, len(samples)))]
        r0 = (s // eng.batch_size) * eng.batch_size
        rchunk = list(range(r0, min(r0 + eng.batch_size, len(samples))))
        upto = len(samples[s].prompt_ids) + f["position"] + 1
        run = lambda: first_diff(eng.capture([samples[i].ids for i in rchunk], None, rchunk, s - r0, score=True),
                                 hf_capture(tr, tchunk, s - c0), upto)
        what = {"vllm_score_batch": rchunk, "hf_micro_batch": list(range(c0, c0 + len(tchunk))), "sequence": s}
    a, b = run(), run()
    return {"gate": gate, "compared": what, "first_difference": a, "repeat": b, "reproduced": a == b and a is not None}


found = {}
for r in results:
    if r.gate in ("C3", "C4", "C5") and r.verdict == "fail" and cfg.rollout.engine == "vllm":
        try:
            found[r.gate] = locate(r.gate, r)
        except Exception as e:  # keep the ladder's records even when localisation breaks
            found[r.gate] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{name}] capture {r.gate}: {json.dumps(found[r.gate])}", flush=True)
atomic_write_text(out / f"{name}-capture.json", json.dumps(found, indent=1))
