"""Minimal, self-verifying repro of the first divergent operator.

The two computations are the culprit operator as each side ran it, on its real recorded inputs. Rows that
do not change the outcome are dropped by delta debugging (the difference at the traced token must survive
every removal). The script is rendered from a jinja2 template, run in a fresh process, and kept only if it
exits 1 there, i.e. it really reproduces.
"""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tic.harness.capture import OpCall, same_bits
from tic.skill.state import atomic_write_bytes, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"


@dataclass
class OpSide:
    """One side's operator call: the call, where the traced token's value sits in its output, its row count."""

    call: OpCall
    where: dict  # {"kind": "row"|"bt"|"bht", "output": k, ...}
    rows: int  # leading-dim rows of the call: tokens (kind "row") or sequences (kinds "bt", "bht")


def pick(out, where: dict) -> torch.Tensor:
    ts = [out] if isinstance(out, torch.Tensor) else [x for x in out if isinstance(x, torch.Tensor)]
    t = ts[where["output"]]
    if where["kind"] == "bt":
        return t[where["b"], where["t"]]
    if where["kind"] == "bht":
        return t[where["b"], :, where["t"]]
    return t[where["row"]]


def _values_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        a, b = a.to(torch.float64), b.to(torch.float64)
    return not same_bits(a, b)


def _run(side: OpSide, args, kwargs, where) -> torch.Tensor:
    return pick(side.call.func(*args, **kwargs), where)


def _subset(side: OpSide, keep: list[int]):
    """The call's args with only rows `keep` of every row-carrying tensor, and where the traced row lands."""
    idx = torch.tensor(keep, dtype=torch.long)
    args = tuple(a.index_select(0, idx.to(a.device)) if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == side.rows
                 else a for a in side.call.args)
    key = "row" if side.where["kind"] == "row" else "b"
    where = dict(side.where, **{key: keep.index(side.where[key])})
    return args, dict(side.call.kwargs), where


def _ddmin(rows: list[int], must: int, differs) -> list[int]:
    """Smallest row set (containing `must`) found by delta debugging for which `differs(rows)` holds."""
    others = [r for r in rows if r != must]
    n = 2
    while others:
        chunk = max(1, len(others) // n)
        for i in range(0, len(others), chunk):
            cand = others[:i] + others[i + chunk:]
            if differs(sorted(cand + [must])):
                others, n = cand, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(others), n * 2)
    return sorted(others + [must])


def shrink(a: OpSide | None, b: OpSide, a_value: torch.Tensor | None) -> tuple[dict | None, dict, int]:
    """Shrink each side's rows while the difference persists. Returns the two calls and the evaluations."""
    evals = 0
    state = {
        "a": None if a is None else (a.call.args, dict(a.call.kwargs), dict(a.where)),
        "b": (b.call.args, dict(b.call.kwargs), dict(b.where)),
    }

    def value(key, side):
        if side is None:
            return a_value
        args, kwargs, where = state[key]
        return _run(side, args, kwargs, where)

    def trial(key, side, keep):
        nonlocal evals
        evals += 1
        saved = state[key]
        state[key] = _subset(side, keep)
        try:
            ok = _values_differ(value("a", a), value("b", b))
        except (RuntimeError, ValueError, IndexError, TypeError):
            ok = False  # the operator refuses this shape: keep the rows
        if not ok:
            state[key] = saved
        return ok

    for key, side in (("a", a), ("b", b)):
        if side is None or side.rows <= 1 or not side.call.op.startswith("aten."):
            continue  # custom kernels (e.g. vLLM's attention) tie rows together through other arguments
        must = side.where["row" if side.where["kind"] == "row" else "b"]
        keep = _ddmin(list(range(side.rows)), must, lambda k: trial(key, side, k))
        if len(keep) < side.rows and not trial(key, side, keep):  # leave the state at the minimum found
            state[key] = (side.call.args, dict(side.call.kwargs), dict(side.where))
    pack = lambda s: None if s is None else {"args": s[0], "kwargs": s[1], "where": s[2]}  # noqa: E731
    return pack(state["a"]), pack(state["b"]), evals


def _rows_of(call: dict | None, fallback: int) -> int:
    if call is None:
        return fallback
    for x in call["args"]:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    return fallback


def op_imports(*ops: str | None) -> list[str]:
    """Modules a fresh process must import to have these operators: the loaded extension module named like the
    operator's namespace (e.g. vllm.vllm_flash_attn._vllm_fa3_C for torch.ops._vllm_fa3_C); none for aten."""
    out = []
    for op in ops:
        ns = op.split(".")[0] if op else "aten"
        if ns in ("aten", "prims"):
            continue
        hits = sorted((m for m in list(sys.modules) if m.split(".")[-1] == ns), key=lambda m: (m.startswith("torch"), m))
        if hits and hits[0] not in out:
            out.append(hits[0])
    return out


def emit(out_dir: Path, gate: str, a: OpSide | None, b: OpSide, a_value: torch.Tensor | None,
         side_a: str, side_b: str, headline: str) -> dict:
    """Shrink, write repro.py + repro_tensors.pt, run it in a fresh process; report what happened."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    out_dir = Path(out_dir)
    call_a, call_b, evals = shrink(a, b, a_value)
    data = {"op": b.call.op, "a_op": a.call.op if a else None, "a": call_a, "b": call_b,
            "a_value": None if a_value is None else a_value.clone()}
    buf = io.BytesIO()
    torch.save(data, buf)
    tensor_file = "repro_tensors.pt"
    rows_a = "1 (its input value)" if a is None else _rows_of(call_a, a.rows)
    rows_b = _rows_of(call_b, b.rows)
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True)
    script = env.get_template("repro.py.j2").render(
        gate=gate, headline=headline, side_a=side_a, side_b=side_b, op=b.call.op, has_a=a is not None,
        rows_a=rows_a, rows_b=rows_b,
        unit="tokens" if b.where["kind"] == "row" else "sequences of the batch",
        threads=torch.get_num_threads(), tensor_file=tensor_file,
        imports=op_imports(b.call.op, a.call.op if a else None))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / tensor_file, buf.getvalue())
    path = out_dir / "repro.py"
    atomic_write_text(path, script)
    proc = subprocess.run([sys.executable, str(path.resolve())], cwd=out_dir.resolve(), capture_output=True,
                          text=True, timeout=300)
    result = {"script": str(path), "tensors": str(out_dir / tensor_file), "exit_code": proc.returncode,
              "output": (proc.stdout + proc.stderr).strip()[-2000:], "rows_a": rows_a, "rows_b": rows_b,
              "shrink_evaluations": evals,
              # exit 1 *and* the script's own verdict line: an uncaught error elsewhere cannot pass as a repro
              "reproduces": proc.returncode == 1 and any(
                  line.startswith("DIFFERS") for line in proc.stdout.splitlines())}
    if not result["reproduces"]:  # a repro that does not reproduce is not emitted
        path.unlink(missing_ok=True)
        (out_dir / tensor_file).unlink(missing_ok=True)
        result["script"] = None
        result["tensors"] = None
    return result
