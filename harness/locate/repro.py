"""Minimal, self-verifying repro of the first divergent operator.

The two computations are the culprit operator as each side ran it, on its real recorded inputs laid out in memory
as the engine's were (tic.harness.locate.replay). Rows that do not change the outcome are dropped by delta debugging
(the difference at the traced token must survive every removal). The script is rendered from a jinja2 template
that carries tic.harness.locate.replay verbatim, run in a fresh process, and kept only if it exits 1 there, i.e. it
really reproduces; it says itself which kind of difference it shows (replay.difference).
"""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tic.harness.locate import replay
from tic.harness.locate.trail import OpCall
from tic.core.fsio import atomic_write_bytes, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"


@dataclass
class OpSide:
    """One side's operator call: the call, where the traced token's value sits in its output, its row count,
    and the traced token's elements of each argument (shaped like (args, kwargs); None where it has none)."""

    call: OpCall
    where: dict  # {"kind": "row"|"bt"|"bht"|"whole"|"mask", "output": k, ...}
    rows: int  # leading-dim rows of the call: tokens (kind "row") or sequences (kinds "bt", "bht")
    token_args: tuple | None = None


def _values_differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two traced values differ in any bit (in any shape: one layout's row [D], another's [1, D])."""
    if a.dtype != b.dtype:
        a, b = a.to(torch.float64), b.to(torch.float64)
    return not replay.same_value(a, b)


def _layouts(side: OpSide) -> tuple:
    call = side.call
    return call.layouts or (tuple(replay.layout_tree(a) for a in call.args),
                            {k: replay.layout_tree(v) for k, v in call.kwargs.items()})


def _copies(side: OpSide, args, kwargs) -> tuple[tuple, dict]:
    """Copies of a call's arguments laid out as the engine's were: in-place kernels (vLLM's fused_add_rms_norm
    writes its input and residual) must not change the values a later evaluation or the saved repro starts from,
    and kernels take other paths for other strides or alignments."""
    lay_args, lay_kwargs = _layouts(side)
    return (tuple(replay.rebuild_tree(a, lay) for a, lay in zip(args, lay_args)),
            {k: replay.rebuild_tree(v, lay_kwargs.get(k)) for k, v in kwargs.items()})


def _run(side: OpSide, args, kwargs, where) -> torch.Tensor:
    return replay.pick(replay.outputs_of(side.call.func, *_copies(side, args, kwargs)), where)


def replay_mismatch(side: OpSide, name: str) -> str | None:
    """Why replaying the recorded call here does not give the value the engine computed (the message calls the
    call side `name`), or None if it does."""
    args, kwargs = _copies(side, side.call.args, side.call.kwargs)
    got = replay.pick(replay.outputs_of(side.call.func, args, kwargs), side.where)
    try:
        replay.check_replay(got, replay.pick(list(side.call.outputs), side.where), name, args, _layouts(side)[0])
    except RuntimeError as e:
        return str(e)
    return None


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


def shrink(a: OpSide | None, b: OpSide, a_value: torch.Tensor | None, skip: dict | None = None) \
        -> tuple[dict | None, dict, int]:
    """Shrink each side's rows while the difference persists (not the sides in `skip`). Returns the two calls and
    the evaluations."""
    skip = skip or {}
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

    cuts: dict = {"a": None, "b": None}  # how each side's call was cut (cut_call), for a recheck to cut alike
    for key, side in (("a", a), ("b", b)):
        if side is None or skip.get(key):
            continue
        reduced = one_sequence(side, *state[key])
        if reduced is not None:
            if trial(key, reduced):
                cuts[key] = {"one_sequence": True}
            continue
        if side.rows <= 1 or not side.call.op.startswith("aten."):
            continue  # custom kernels (e.g. vLLM's attention) tie rows together through other arguments
        must = side.where["row" if side.where["kind"] == "row" else "b"]
        keep = _ddmin(list(range(side.rows)), must, lambda k: trial(key, _subset(side, k)))
        if len(keep) < side.rows and trial(key, _subset(side, keep)):  # the state at the minimum found
            cuts[key] = {"rows": keep}
        else:
            state[key] = (side.call.args, dict(side.call.kwargs), dict(side.where))
    pack = lambda s, c: None if s is None else {"args": s[0], "kwargs": s[1], "where": s[2], "cut": c}  # noqa: E731
    return pack(state["a"], cuts["a"]), pack(state["b"], cuts["b"]), evals


def cut_call(side: OpSide, cut: dict | None) -> tuple[tuple, dict, dict]:
    """(args, kwargs, where) of the side's call cut as `shrink` cut a call ("cut" of its entry): to rows
    cut["rows"], or to the traced token's sequence alone; the whole call without a cut, or where the cut does
    not apply to it."""
    whole = (side.call.args, dict(side.call.kwargs), dict(side.where))
    if cut and cut.get("one_sequence"):
        return one_sequence(side, *whole) or whole
    if cut and cut.get("rows") and side.rows > max(cut["rows"]):
        return _subset(side, cut["rows"])
    return whole


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


def proves_same_arguments(proves: str | None) -> bool:
    """Whether a repro's verdict is one operator on the traced token's bit-identical arguments."""
    return bool(proves) and proves.startswith(replay.SAME_ARGUMENTS)


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

    runtime = Path(replay.__file__).read_text()

    def script(proves: str) -> str:
        return template.render(threads=torch.get_num_threads(), tensor_file=tensor_file, imports=op_imports(*ops),
                               kernels=sorted({op.partition(":")[0] for op in ops if op and ":" in op}),
                               setup=list(setup or []), proves=proves, runtime=runtime, **render)

    claimed = replay.claim(data["a"], data["b"])
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
              "same_operator_identical_inputs": proves_same_arguments(proven),
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


def emit(out_dir: Path, gate: str, ref: OpSide | None, new: OpSide, ref_value: torch.Tensor | None,
         side_a: str, side_b: str, headline: str, setup: list[str] | None = None, new_side: str = "B") -> dict:
    """One operator, shrunk, as both sides ran it on the same inputs: `new` is the call of engine side `new_side`
    whose value the other side never computes, `ref` the other side's counterpart (None: the other side's value
    is `ref_value`, the input of a conversion only `new_side` runs). The repro names the sides as the engines'
    (side_a, side_b). Each side's value as computed here is kept: the fresh process must give the same bits (else
    its kernels are not the ones that ran here). A side whose replay here does not give the engine's value is not
    shrunk, and keeps the engine's value: its fresh replay then fails (exit 3) saying which recorded property it
    could not rebuild."""
    with torch.inference_mode():  # the recorded tensors come from engines' inference-mode forwards; kernels
        ref_side = "A" if new_side == "B" else "B"
        mismatch = {k: replay_mismatch(s, name) for k, s, name in (("a", ref, ref_side), ("b", new, new_side))
                    if s is not None}  # shrink's "a" is the counterpart, "b" the first divergent call
        call_ref, call_new, evals = shrink(ref, new, ref_value, skip=mismatch)  # that write `out` need the mode
        for key, call, side in (("a", call_ref, ref), ("b", call_new, new)):
            if call is None:
                continue
            call.update(op=side.call.op, launch=getattr(side.call.func, "launch_spec", None),  # launched kernels
                        layouts=_layouts(side), token_args=side.token_args)
            call["expect"] = replay.pick(list(side.call.outputs), side.where).detach().clone() if mismatch[key] \
                else _run(side, call["args"], call["kwargs"], call["where"]).detach().clone()
    rows = {new_side: _rows_of(call_new, new.rows),
            ref_side: "1 (its input value)" if ref is None else _rows_of(call_ref, ref.rows)}
    data = {new_side.lower(): call_new, ref_side.lower(): call_ref,
            f"{ref_side.lower()}_value": None if ref_value is None else ref_value.clone()}
    res = _imports_and_check(
        out_dir, data, [new.call.op] + ([ref.call.op] if ref else []), gate=gate, headline=headline,
        side_a=side_a, side_b=side_b, op=new.call.op, what=new.call.op, missing=None if ref else ref_side,
        module=None, calls_a=0, calls_b=0, rows_a=rows["A"], rows_b=rows["B"], setup=setup,
        unit="tokens" if new.where["kind"] == "row" else "sequences of the batch")
    res["shrink_evaluations"] = evals
    res["replay_mismatch"] = {(new_side if k == "b" else ref_side): v for k, v in mismatch.items() if v}
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
        calls.append({"op": call.op, "launch": getattr(call.func, "launch_spec", None), "layouts": call.layouts,
                      "args": tuple(_with_refs(a, s) for a, s in zip(call.args, src_args)),
                      "kwargs": {k: _with_refs(v, src_kwargs.get(k)) for k, v in call.kwargs.items()}})
    return {"calls": calls, "target": target, "where": where, "recorded": recorded.clone(),
            "rows": trail.batch * trail.length}


def emit_module(out_dir: Path, gate: str, module: str, prog_a: dict, prog_b: dict, side_a: str, side_b: str,
                headline: str, setup: list[str] | None = None) -> dict:
    """Both sides' operator sequences for one module, replayed on their recorded module inputs."""
    ops = sorted({c["op"] for p in (prog_a, prog_b) for c in p["calls"]})
    res = _imports_and_check(
        out_dir, {"a": prog_a, "b": prog_b}, ops, gate=gate, headline=headline, side_a=side_a,
        side_b=side_b, op=module, what=module, missing=None, module=module, calls_a=len(prog_a["calls"]),
        calls_b=len(prog_b["calls"]), rows_a=prog_a["rows"], rows_b=prog_b["rows"], unit="token rows of the call",
        setup=setup)
    res["shrink_evaluations"] = 0
    return res
