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

from tic.harness.capture import OpCall, _clone, _tree_map, call_outputs, same_bits
from tic.harness.launch_record import clone_layout
from tic.core.fsio import atomic_write_bytes, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"


@dataclass
class OpSide:
    """One side's operator call: the call, where the traced token's value sits in its output, its row count."""

    call: OpCall
    where: dict  # {"kind": "row"|"bt"|"bht"|"whole"|"mask", "output": k, ...}
    rows: int  # leading-dim rows of the call: tokens (kind "row") or sequences (kinds "bt", "bht")


def outputs_of(func, args, kwargs) -> list[torch.Tensor]:
    """Run the operator; its outputs as the recorder counts them (capture.call_outputs)."""
    return call_outputs(func, args, kwargs, func(*args, **kwargs))


def pick(ts: list[torch.Tensor], where: dict) -> torch.Tensor:
    t = ts[where["output"]]
    if where["kind"] == "whole":
        return t
    if where["kind"] == "mask":  # the traced token's elements, found by data (tic.harness.provenance)
        return t[where["mask"].to(t.device)]
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
    """The operator on copies of the arguments: in-place kernels (vLLM's fused_add_rms_norm writes its input
    and residual) must not change the values a later evaluation or the saved repro starts from. A kernel
    launched from Python addresses memory by explicit strides: its copies keep the recorded layout."""
    launched = getattr(side.call.func, "launch_spec", None) is not None
    copy = (lambda v: clone_layout(v) if isinstance(v, torch.Tensor) else v) if launched else _clone  # noqa: E731
    copies = _tree_map(copy, args), {k: _tree_map(copy, v) for k, v in kwargs.items()}
    return pick(outputs_of(side.call.func, *copies), where)


def _subset(side: OpSide, keep: list[int]):
    """The call's args with only rows `keep` of every row-carrying tensor, and where the traced row lands."""
    idx = torch.tensor(keep, dtype=torch.long)
    per_row = lambda a: isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == side.rows  # noqa: E731
    args = tuple(a.index_select(0, idx.to(a.device)) if per_row(a) else a for a in side.call.args)
    key = "row" if side.where["kind"] == "row" else "b"
    where = dict(side.where, **{key: keep.index(side.where[key])})
    return args, dict(side.call.kwargs), where


# Varlen attention kernels over a paged KV cache (FlashAttention 2/3 as vLLM calls them) tie a call's token rows
# together through cu_seqlens_q / seqused_k / the page table, so rows cannot be dropped one by one. What can be
# dropped is every other sequence: the traced token's sequence alone, with only its own KV pages. Recognised by
# the schema's argument names, so any kernel with this calling convention is reduced the same way.
PAGED_VARLEN = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "page_table")  # and `out`, when the caller gives one


def one_sequence(side: OpSide, args, kwargs, where):
    """The call reduced to the traced token's sequence and its KV pages, or None if it is not a paged varlen
    attention call (by schema) or the traced value is not a row of its output."""
    try:
        names = [a.name for a in side.call.func._schema.arguments]
    except AttributeError:
        return None
    bound = dict(zip(names, args), **kwargs)
    if where.get("kind") != "row" or not all(isinstance(bound.get(n), torch.Tensor) for n in PAGED_VARLEN):
        return None
    q, k, cu, used, pages = (bound[n] for n in ("q", "k", "cu_seqlens_q", "seqused_k", "page_table"))
    if k.dim() != 4 or bound.get("cu_seqlens_k") is not None:
        return None
    cuts = cu.tolist()
    row = where["row"]
    seq = next((i for i in range(len(cuts) - 1) if cuts[i] <= row < cuts[i + 1]), None)
    if seq is None:
        return None
    a, b, n_keys = cuts[seq], cuts[seq + 1], int(used[seq])
    n_pages = -(-n_keys // k.shape[1])
    keep = pages[seq, :n_pages].long()
    new = dict(bound)
    out = bound.get("out")
    new.update(q=q[a:b].clone(), out=None if out is None else out[a:b].clone(), k=k.index_select(0, keep),
               v=bound["v"].index_select(0, keep),
               cu_seqlens_q=torch.tensor([0, b - a], dtype=cu.dtype, device=cu.device),
               seqused_k=used[seq:seq + 1].clone(),
               page_table=torch.arange(n_pages, dtype=pages.dtype, device=pages.device)[None])
    if "max_seqlen_q" in new:
        new["max_seqlen_q"] = b - a
    if "max_seqlen_k" in new:
        new["max_seqlen_k"] = n_keys
    if "scheduler_metadata" in new:
        new["scheduler_metadata"] = None  # planned for the whole step's batch: the kernel plans the one sequence
    n_args = len(args)
    return (tuple(new[nm] for nm in names[:n_args]), {nm: new[nm] for nm in kwargs},
            dict(where, row=row - a))


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

    def trial(key, candidate):
        """Take `candidate` (args, kwargs, where) for side `key` if the two values still differ with it."""
        nonlocal evals
        evals += 1
        saved = state[key]
        state[key] = candidate
        try:
            ok = _values_differ(value("a", a), value("b", b))
        except (RuntimeError, ValueError, IndexError, TypeError):
            ok = False  # the operator refuses this shape: keep the rows
        if not ok:
            state[key] = saved
        return ok

    for key, side in (("a", a), ("b", b)):
        if side is None:
            continue
        reduced = one_sequence(side, *state[key])
        if reduced is not None:
            trial(key, reduced)
            continue
        if side.rows <= 1 or not side.call.op.startswith("aten."):
            continue  # custom kernels (e.g. vLLM's attention) tie rows together through other arguments
        must = side.where["row" if side.where["kind"] == "row" else "b"]
        keep = _ddmin(list(range(side.rows)), must, lambda k: trial(key, _subset(side, k)))
        if len(keep) < side.rows and not trial(key, _subset(side, keep)):  # leave the state at the minimum found
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
    operator's namespace (torch.ops._vllm_fa3_C -> vllm.vllm_flash_attn._vllm_fa3_C), or named after it with a
    suffix (torch.ops._C -> vllm._C_stable_libtorch), else a Python module of that name (a test's op library);
    none for aten and prims. torch's own modules only when nothing else matches."""
    out: list[str] = []
    mods = dict(sys.modules)
    ext = lambda m: str(getattr(mods[m], "__file__", "") or "").endswith(".so")  # noqa: E731
    last = lambda m: m.split(".")[-1]  # noqa: E731
    ours = lambda m: not m.startswith("torch")  # noqa: E731
    for op in ops:
        ns = op.split(".")[0] if op else "aten"
        if ns in ("aten", "prims") or ":" in (op or ""):  # module:qualname: a launched kernel, imported by path
            continue
        exact = [m for m in mods if last(m) == ns]
        suffixed = [m for m in mods if last(m).startswith(ns + "_") and ext(m)]
        # every extension that may define the namespace (torch.ops._C: vllm._C_stable_libtorch, but also
        # vllm.third_party.deep_gemm._C): importing one more is harmless, missing the right one is not
        for group in ([m for m in exact if ext(m) and ours(m)] + [m for m in suffixed if ours(m)],
                      [m for m in exact if ours(m)], exact):
            if group:
                for m in sorted(group, key=lambda m: (m.startswith("torch"), m)):
                    if m not in out:
                        out.append(m)
                break
    return out


SAME_OPERATOR = "same operator, identical inputs, different bits"


def _identical(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.device == y.device
                and same_bits(x, y))
    if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
        return isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) \
            and all(_identical(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) or isinstance(y, dict):
        return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() \
            and all(_identical(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def claim(a: dict | None, b: dict) -> str:
    """What a repro of calls a and b shows, as the script itself decides it in the fresh process (the template's
    `claim`): "same operator, identical inputs, different bits" only for one operator on bit-identical
    arguments; otherwise an implementation difference, naming what differs."""
    if a is None:
        return "implementation difference: side A has no such operator (its value is side B's input)"
    if "calls" in a or "calls" in b:
        return "implementation difference: the two sides compute the module with different operator sequences"
    if a["op"] != b["op"]:
        return f"implementation difference: operator {a['op']} vs {b['op']}"
    if not _identical(a.get("launch"), b.get("launch")):
        return "implementation difference: the kernel is launched on another grid or writes other arguments"
    for what, x, y in (("arguments", a["args"], b["args"]), ("keyword arguments", a["kwargs"], b["kwargs"])):
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                if not _identical(u, v):
                    if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape != v.shape:
                        return (f"implementation difference: argument {i} has shape {list(u.shape)} on side A, "
                                f"{list(v.shape)} on side B")
                    return f"implementation difference: argument {i} differs between the two calls"
        elif not _identical(x, y):
            return f"implementation difference: the {what} differ"
    if not _identical(a["where"], b["where"]):
        return "implementation difference: the compared value sits at different places of the two outputs"
    return SAME_OPERATOR


def _imports_and_check(out_dir: Path, data: dict, ops: list[str], setup: list[str] | None = None,
                       **render) -> dict:
    """Write repro.py + repro_tensors.pt, run the script in a fresh process; keep it only if it reproduces."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    out_dir = Path(out_dir)
    buf = io.BytesIO()
    torch.save(data, buf)
    tensor_file = "repro_tensors.pt"
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True)
    template = env.get_template("repro.py.j2")

    def script(proves: str) -> str:
        return template.render(threads=torch.get_num_threads(), tensor_file=tensor_file, imports=op_imports(*ops),
                               kernels=sorted({op.partition(":")[0] for op in ops if op and ":" in op}),
                               setup=list(setup or []), proves=proves, **render)

    claimed = claim(data["a"], data["b"])
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / tensor_file, buf.getvalue())
    path = out_dir / "repro.py"
    atomic_write_text(path, script(claimed))
    proc = subprocess.run([sys.executable, str(path.resolve())], cwd=out_dir.resolve(), capture_output=True,
                          text=True, timeout=300)
    # the fresh process's own reading of what the two computations are (its CHECKS line; PROVES follows only
    # when their bits differ)
    proven = next((line.removeprefix("CHECKS: ") for line in proc.stdout.splitlines() if line.startswith("CHECKS: ")),
                  None)
    if proven is not None and proven != claimed:  # the fresh process has the last word on what it shows
        atomic_write_text(path, script(proven))
    result = {"script": str(path), "tensors": str(out_dir / tensor_file), "exit_code": proc.returncode,
              "output": proc.stdout.strip()[-2000:], "stderr": proc.stderr.strip()[-1000:], "rows_a": render["rows_a"],
              "rows_b": render["rows_b"], "proves": proven,
              "same_operator_identical_inputs": proven == SAME_OPERATOR,
              # exit 1 *and* the script's own verdict line: an uncaught error elsewhere cannot pass as a repro
              "reproduces": proc.returncode == 1 and any(
                  line.startswith("DIFFERS") for line in proc.stdout.splitlines())}
    if not result["reproduces"]:  # a repro that does not reproduce is not emitted
        path.unlink(missing_ok=True)
        (out_dir / tensor_file).unlink(missing_ok=True)
        result["script"] = None
        result["tensors"] = None
    return result


def rerun(script: Path, data: dict, out_dir: Path) -> dict:
    """An emitted repro script run, in a fresh process, on other tensors (e.g. one side's entry recorded again
    after a fix): the script copied into `out_dir` next to `data` saved as its tensor file. Kept either way."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(data, buf)
    atomic_write_bytes(out_dir / "repro_tensors.pt", buf.getvalue())
    path = out_dir / "repro.py"
    atomic_write_text(path, Path(script).read_text())
    proc = subprocess.run([sys.executable, str(path.resolve())], cwd=out_dir.resolve(), capture_output=True,
                          text=True, timeout=300)
    return {"script": str(path), "exit_code": proc.returncode, "output": proc.stdout.strip()[-2000:],
            "stderr": proc.stderr.strip()[-1000:]}


def emit(out_dir: Path, gate: str, a: OpSide | None, b: OpSide, a_value: torch.Tensor | None,
         side_a: str, side_b: str, headline: str, setup: list[str] | None = None) -> dict:
    """One operator, shrunk, as both sides ran it on the same inputs. Each side's value as computed here is
    kept: the fresh process must give the same bits (else its kernels are not the ones that ran here)."""
    with torch.inference_mode():  # the recorded tensors come from engines' inference-mode forwards; kernels
        call_a, call_b, evals = shrink(a, b, a_value)  # that write their `out` argument need the same mode
        for call, side in ((call_a, a), (call_b, b)):
            if call is not None:
                call["op"] = side.call.op
                call["launch"] = getattr(side.call.func, "launch_spec", None)  # a kernel launched from Python
                call["expect"] = _run(side, call["args"], call["kwargs"], call["where"]).detach().clone()
    data = {"a": call_a, "b": call_b, "a_value": None if a_value is None else a_value.clone()}
    rows_a = "1 (its input value)" if a is None else _rows_of(call_a, a.rows)
    res = _imports_and_check(
        out_dir, data, [b.call.op] + ([a.call.op] if a else []), gate=gate, headline=headline, side_a=side_a,
        side_b=side_b, op=b.call.op, what=b.call.op, has_a=a is not None, module=None, calls_a=0, calls_b=0,
        rows_a=rows_a, rows_b=_rows_of(call_b, b.rows), setup=setup,
        unit="tokens" if b.where["kind"] == "row" else "sequences of the batch")
    res["shrink_evaluations"] = evals
    return res


# -- a whole module, when the two sides implement it with different operators ------------------------------
def _with_refs(v, src):
    if isinstance(v, (list, tuple)):
        return type(v)(_with_refs(x, y) for x, y in zip(v, src))
    return {"ref": list(src)} if src is not None else v


def module_program(trail, target: int, where: dict, recorded: torch.Tensor) -> dict:
    """The trail's operator calls up to `target`, each tensor argument either a recorded value from outside the
    module or a reference to an earlier call's output, so that a fresh process replays the module's arithmetic."""
    calls = []
    for call in trail.calls[:target + 1]:
        src_args, src_kwargs = call.sources if call.sources is not None else ((None,) * len(call.args), {})
        calls.append({"op": call.op, "launch": getattr(call.func, "launch_spec", None),
                      "args": tuple(_with_refs(a, s) for a, s in zip(call.args, src_args)),
                      "kwargs": {k: _with_refs(v, src_kwargs.get(k)) for k, v in call.kwargs.items()}})
    return {"calls": calls, "target": target, "where": where, "recorded": recorded.clone(),
            "rows": trail.batch * trail.length}


def emit_module(out_dir: Path, gate: str, module: str, prog_a: dict, prog_b: dict, side_a: str, side_b: str,
                headline: str, setup: list[str] | None = None) -> dict:
    """Both sides' operator sequences for one module, replayed on their recorded module inputs."""
    ops = sorted({c["op"] for p in (prog_a, prog_b) for c in p["calls"]})
    res = _imports_and_check(
        out_dir, {"a": prog_a, "b": prog_b, "a_value": None}, ops, gate=gate, headline=headline, side_a=side_a,
        side_b=side_b, op=module, what=module, has_a=True, module=module, calls_a=len(prog_a["calls"]),
        calls_b=len(prog_b["calls"]), rows_a=prog_a["rows"], rows_b=prog_b["rows"], unit="token rows of the call",
        setup=setup)
    res["shrink_evaluations"] = 0
    return res
