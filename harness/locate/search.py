"""Localise a bitwise divergence: first divergent layer, then module, then operator, then a minimal repro.

Side A and side B run the same compared sequence (same weights, same tokens) in their own layouts, with
capture hooks (tic.harness.locate.capture). The loop:
  1. stages (embeddings, rotary, decoder layers, final norm, head) compared bitwise in order: the first that
     differs is the first divergent layer;
  2. replay: side B reruns with side A's recorded inputs (every token-row tensor argument: hidden states,
     position embeddings, ...) fed to that layer and to each of its submodules at once, so each module's
     output is seen on identical inputs in one extra run. If the layer then agrees, the cause is upstream
     (an input that is not per token: a mask, the cache). Otherwise descend: the first child in
     execution order that still differs, until no child does: that module is the culprit;
  3. inside the culprit, both sides' operator sequences are recorded (TorchDispatchMode) for the forward call
     that computes the first differing token; which elements of each call belong to that token is followed by
     data (tic.harness.locate.provenance), whatever order the kernels visit rows in. The first operator on side B
     whose value for that token is not a value side A computed is the first divergent operator; when side B
     has none, or its counterpart on side A already had other inputs, side A took a step of its own first and
     the search runs from side A;
  4. that operator is reduced to a minimal repro (tic.harness.locate.repro), verified in a fresh process, which also
     says what it shows: one operator on identical inputs, or an implementation difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tic.core.errors import TicInputError
from tic.harness.locate import replay
from tic.harness.locate import repro as repro_mod
from tic.harness.locate import report
from tic.harness.locate.capture import Capture, CaptureRunner, CaptureSpec, rows_equal
from tic.harness.locate.runners import runner_for
from tic.harness.locate.trail import Trail, same_bits
from tic.harness.measure.layouts import describe_train_layout, probe_batch
from tic.harness.measure.metrics import _ordered_int


@dataclass
class Side:
    label: str  # e.g. "rollout decode (KV cache, batch of 8)"
    runner: CaptureRunner
    run: Callable[[CaptureSpec], Capture]


# -- comparing captured rows ------------------------------------------------------------------------------
def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if not (a.is_floating_point() and b.is_floating_point()) or a.numel() != b.numel():
        return 0
    if a.dtype != b.dtype:  # ulps only mean something in one dtype; compare the wider of the two
        a, b = a.to(torch.float64), b.to(torch.float64)
    d = (_ordered_int(a.flatten()) - _ordered_int(b.flatten())).abs()
    return int(d.max()) if d.numel() else 0


def _comparable(a: tuple, b: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs of one token's rows that hold the same quantity on both sides: the same element count and dtype
    (a tensor of another size, e.g. attention weights over another number of keys, is a layout's, not a value)."""
    return [(x, y) for x, y in zip(a, b) if x.numel() == y.numel() and x.dtype == y.dtype]


def compare_rows(a: dict[int, tuple], b: dict[int, tuple]) -> dict:
    """Per position of the compared sequence, one module's rows on both sides, bit for bit (positions where
    either side recorded nothing comparable are not compared)."""
    pairs = {p: _comparable(a[p], b[p]) for p in sorted(set(a) & set(b))}
    common = [p for p, got in pairs.items() if got]
    diff = [p for p in common if not all(same_bits(x.reshape(-1), y.reshape(-1)) for x, y in pairs[p])]
    elements, max_ulp = 0, 0
    for p in diff:
        for x, y in pairs[p]:
            elements += int((replay.as_bits(x) != replay.as_bits(y)).sum())
            max_ulp = max(max_ulp, _ulps(x, y))
    return {"positions": len(common), "differing_positions": len(diff), "first_position": diff[0] if diff else None,
            "differing_elements": elements, "max_ulp": max_ulp, "equal": not diff and bool(common)}


# -- operator trails ----------------------------------------------------------------------------------------
def token_value(t: torch.Tensor, tokens: torch.Tensor | None, B: int, T: int, f: int):
    """(where, value, rows) of token f's elements of t, by t's token map (tic.harness.locate.provenance); None if t
    holds none of them. `where` says how a repro picks the same elements from the call's output: a row of a
    per-token layout ("row", "bt", "bht"), the whole tensor, or a mask of elements; `rows` is how many rows
    (tokens, or sequences for "bt"/"bht") the call's leading dimension holds."""
    if tokens is None or tuple(tokens.shape) != tuple(t.shape):
        return None
    mask = tokens == f
    n = int(mask.sum())
    if n == 0:
        return None
    if n == mask.numel():
        if t.dim() >= 1 and t.shape[0] == 1:
            return {"kind": "row", "row": 0}, t[0], 1
        return {"kind": "whole"}, t, 1
    b, tt = divmod(f, T)
    if t.dim() >= 2 and tuple(t.shape[:2]) == (B, T) and bool(mask[b, tt].all()) and mask[b, tt].numel() == n:
        return {"kind": "bt", "b": b, "t": tt}, t[b, tt], B
    if t.dim() >= 1 and t.shape[0] == B * T and bool(mask[f].all()) and mask[f].numel() == n:
        return {"kind": "row", "row": f}, t[f], B * T
    if t.dim() >= 3 and t.shape[0] == B and t.shape[2] == T and bool(mask[b, :, tt].all()) \
            and mask[b, :, tt].numel() == n:
        return {"kind": "bht", "b": b, "t": tt}, t[b, :, tt], B
    if t.dim() >= 1:  # one whole row of another row layout: a varlen kernel's packed rows, a decode batch
        r = int(mask.reshape(mask.shape[0], -1).any(1).nonzero()[0, 0])
        if mask[r].numel() == n and bool(mask[r].all()):
            return {"kind": "row", "row": r}, t[r], int(t.shape[0])
    return {"kind": "mask", "mask": mask}, t[mask], 1


def _is_view(call) -> bool:
    """A pure view (slice, reshape, transpose): no arithmetic. `to` is declared aliasing but may convert."""
    if not call.func.is_view:
        return False
    src = next((a for a in call.args if isinstance(a, torch.Tensor)), None)
    return src is None or all(o.dtype == src.dtype for o in call.outputs)


def token_parts(trail: Trail, call) -> tuple[tuple, dict]:
    """The traced token's elements of each of a call's arguments, shaped like (args, kwargs): a tensor where the
    argument holds any of them (one per tensor of a list argument: cat, stack), None elsewhere (weights,
    constants, other tokens' rows)."""
    B, T, f = trail.batch, trail.length, trail.flat_index

    def part(a, m):
        if isinstance(a, (list, tuple)):
            return tuple(part(x, mx) for x, mx in zip(a, m if isinstance(m, (list, tuple)) else (None,) * len(a)))
        r = token_value(a, m, B, T, f) if isinstance(a, torch.Tensor) else None
        return None if r is None else r[1]

    arg_tokens = tuple(call.arg_tokens or ()) + (None,) * len(call.args)
    return tuple(part(a, m) for a, m in zip(call.args, arg_tokens)), {k: None for k in call.kwargs}


def _flat(parts) -> list[torch.Tensor]:
    if isinstance(parts, torch.Tensor):
        return [parts]
    return [t for p in (parts or ()) for t in _flat(p)] if isinstance(parts, (list, tuple)) else []


def trail_rows(trail: Trail) -> tuple[list[list[tuple]], list[list[torch.Tensor]]]:
    """Per op call: the traced token's output values [(output k, where, value, rows)] (none for a view), and its
    input values.

    Which elements of a call belong to the traced token comes from the recorder's token maps: by data (views
    share their storage's tokens, computed values inherit their inputs'), whatever the order in which an
    engine or kernel visits rows, heads or projections, and whatever shape a per-head tensor happens to have."""
    B, T, f = trail.batch, trail.length, trail.flat_index
    outs: list[list[tuple]] = []
    ins: list[list[torch.Tensor]] = []
    for call in trail.calls:
        got = []
        if not _is_view(call):
            out_tokens = call.out_tokens or (None,) * len(call.outputs)
            for k, (o, m) in enumerate(zip(call.outputs, out_tokens)):
                r = token_value(o, m, B, T, f)
                if r is not None:
                    got.append((k, {**r[0], "output": k}, r[1], r[2]))
        outs.append(got)
        ins.append(_flat(token_parts(trail, call)[0]))  # a view's input too: a value this side has
    return outs, ins


def _key(t: torch.Tensor) -> tuple:
    """A value's identity for comparing the two sides: dtype, element count and every byte, for any shape or
    strides (one token's row [D] of a batched call and the [1, D] of a row-by-row call are the same value)."""
    return str(t.dtype), t.numel(), replay.bytes_of(t)


def _describe_args(call) -> str:
    parts = []
    for a in call.args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}")
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            parts.append(f"[{len(a)} tensors]")
        else:
            parts.append(repr(a))
    parts += [f"{k}={v!r}" for k, v in call.kwargs.items() if not isinstance(v, torch.Tensor)]
    return ", ".join(parts)


# Operators whose output is their input in another dtype or memory: when side A has no such step, side A's value is
# the operator's input, and the repro compares the two directly.
CAST_OPS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.clone.default",
            "aten.copy_.default", "aten.contiguous.default", "prims.convert_element_type.default"}


def _lossless(value: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """A conversion whose output is its input exactly (bf16 -> fp32) cannot be where two sides part."""
    if not inputs or not (value.is_floating_point() and inputs[0].is_floating_point()):
        return False
    a, b = value.to(torch.float64), inputs[0].to(torch.float64)
    return a.numel() == b.numel() and same_bits(a.reshape(-1), b.reshape(-1))


def module_target(trail: Trail, value: torch.Tensor) -> tuple[int, dict, torch.Tensor] | None:
    """The last call whose output for the traced token is the module's recorded output (bit for bit, in any
    shape): (call, where, the value as picked from that call's output)."""
    outs, _ = trail_rows(trail)
    want = _key(value)
    for ci in range(len(outs) - 1, -1, -1):
        for k, where, v, _rows in outs[ci]:
            if _key(v) == want:
                return ci, where, v
    return None


def _module_program(cap: Capture, module: str, pos: int) -> dict | None:
    """The module's operator sequence up to the call that produced its recorded output for position `pos`, as
    a replayable program (tic.harness.locate.repro.module_program); None if no recorded operator produced it."""
    row = cap.outputs.get(module, {}).get(pos)
    target = module_target(cap.trail, row[0]) if row else None
    # the recorded value as the replay picks it (a per-head module's token is a mask of elements, not a row)
    return None if target is None else repro_mod.module_program(cap.trail, *target)


def _step_kind(trail: Trail, outs: list, ci: int, dtypes: bool = True) -> tuple:
    """What makes two sides' calls the same step of a computation: the operator and the dtype and size of each
    traced-token value it produces (in any shape: a row of one layout, a mask of elements of another). The k-th
    call of a kind on one side is the counterpart of the k-th on the other (a fused pre-add on one side then does
    not shift the pairing of a norm's eps add). Without `dtypes`, sizes only (a GEMM run in another dtype)."""
    return trail.calls[ci].op, tuple((str(v.dtype) if dtypes else "", v.numel()) for _, _, v, _ in outs[ci])


def _rank(trail: Trail, outs: list, ci: int, dtypes: bool) -> int:
    kind = _step_kind(trail, outs, ci, dtypes)
    return sum(1 for cj in range(ci) if outs[cj] and _step_kind(trail, outs, cj, dtypes) == kind)


def _same_arguments(trail_a: Trail, ca: int, trail_b: Trail, cb: int) -> bool:
    """Two calls of one operator whose arguments hold the same bits for the traced token (its elements of each
    traced argument; every other argument whole), by replay.difference's rule."""
    return replay.difference(_entry(trail_a, ca, {}), _entry(trail_b, cb, {}))["kind"] == replay.SAME_ARGUMENTS


def counterpart(trail_a: Trail, outs_a: list, trail_b: Trail, outs_b: list, cb: int, k: int) -> tuple | None:
    """(side A's call, how it was paired) that computes what side B's call `cb` computes for the traced token
    (its output k), or None:
      "same arguments": the same operator on arguments with the same bits for the traced token;
      "same step": else the call of the same step kind (_step_kind) at the same rank;
      "same sizes": else the same operator whose traced values have the same sizes in another dtype, at the same
        rank among such calls (a GEMM run in float64 on one side);
      "same sequence": else, when both sides run the very same sequence of operators, the call at the same place.
    Except in the last case, side A's value for output k must have as many elements as side B's and other bits
    (vLLM's fused qkv GEMM and HF's q_proj GEMM are not one step)."""
    value_b = next(v for kk, _, v, _ in outs_b[cb] if kk == k)
    flat64 = lambda v: (v.to(torch.float64) if v.is_floating_point() else v).reshape(-1)  # noqa: E731

    def usable(ca):
        match = [g for g in outs_a[ca] if g[0] == k and g[2].numel() == value_b.numel()]
        return bool(match) and not rows_equal((flat64(match[0][2]),), (flat64(value_b),))

    op = trail_b.calls[cb].op
    same_op = [ca for ca, got in enumerate(outs_a) if got and trail_a.calls[ca].op == op and usable(ca)]
    ops_a, ops_b = ([ci for ci, c in enumerate(t.calls) if not _is_view(c)] for t in (trail_a, trail_b))

    def at_rank(dtypes: bool) -> int | None:
        kind, r = _step_kind(trail_b, outs_b, cb, dtypes), _rank(trail_b, outs_b, cb, dtypes)
        ranked = [ca for ca, got in enumerate(outs_a) if got and _step_kind(trail_a, outs_a, ca, dtypes) == kind]
        return ranked[r] if r < len(ranked) and ranked[r] in same_op else None

    exact = [ca for ca in same_op if _same_arguments(trail_a, ca, trail_b, cb)]
    if exact:  # several calls on the same arguments: the one at the same rank, if it is one of them
        step = at_rank(True)
        return (step if step in exact else exact[0]), "same arguments"
    for how, dtypes in (("same step", True), ("same sizes", False)):
        ca = at_rank(dtypes)
        if ca is not None:
            return ca, how
    if [trail_a.calls[ci].op for ci in ops_a] == [trail_b.calls[ci].op for ci in ops_b]:
        ca = ops_a[ops_b.index(cb)]
        if any(g[0] == k for g in outs_a[ca]):
            return ca, "same sequence"
    return None


def first_operator(trail_a: Trail, trail_b: Trail) -> dict:
    """The first op on side B whose value for the traced token is none of side A's values (inputs equal), and its
    counterpart on side A (`counterpart`); without one, side B computes that value with a step side A does not
    take ("sequences_differ")."""
    outs_a, ins_a = trail_rows(trail_a)
    outs_b, ins_b = trail_rows(trail_b)
    seen_values = [v for got in outs_a for (_, _, v, _) in got] + [v for got in ins_a for v in got]
    seen = {_key(v) for v in seen_values}
    # a lossless dtype change of a value side A has (e.g. bf16 -> fp32 before a norm) is not a new value
    seen |= {_key(v.to(torch.float64)) for v in seen_values if v.is_floating_point()}
    steps = []
    found = None
    for ci, got in enumerate(outs_b):
        if not got:
            continue
        call = trail_b.calls[ci]
        bad = [g for g in got if _key(g[2]) not in seen
               and not (g[2].is_floating_point() and _key(g[2].to(torch.float64)) in seen)
               and not (call.op in CAST_OPS and _lossless(g[2], ins_b[ci]))]
        steps.append({"op": call.op, "args": _describe_args(call), "equal": not bad})
        if bad and found is None:
            k, where_b, _value_b, rows_b = bad[0]
            found = {"b_call": ci, "b_where": where_b, "b_rows": rows_b, "a_call": None, "a_where": None,
                     "a_rows": 0, "a_value": None, "op": call.op, "b_args": _describe_args(call)}
            paired = counterpart(trail_a, outs_a, trail_b, outs_b, ci, k)
            if paired is not None:
                a_ci, how = paired
                match = next(g for g in outs_a[a_ci] if g[0] == k)
                found.update(a_call=a_ci, a_where=match[1], a_rows=match[3], paired_by=how,
                             a_args=_describe_args(trail_a.calls[a_ci]))
                # whether the counterpart's own inputs are values side B has: if not, side A parted
                # earlier, through a step of its own (a rounding, a scale) that the reverse search names
                b_values = {_key(v) for got_b in outs_b for (_, _, v, _) in got_b} | \
                    {_key(v) for got_b in ins_b for v in got_b}
                found["counterpart_inputs_shared"] = all(_key(v) in b_values for v in ins_a[a_ci])
                parts_a, kw_a = token_parts(trail_a, trail_a.calls[a_ci])
                found["unshared_arguments"] = [
                    key for key, part in [*enumerate(parts_a), *kw_a.items()]
                    if any(_key(v) not in b_values for v in _flat(part))]
            elif ins_b[ci] and call.op in CAST_OPS:
                found["a_value"] = ins_b[ci][0].clone()  # side A skips this conversion: its value is the input
            else:
                found["sequences_differ"] = True  # no counterpart: side B takes a step side A does not
    return {"found": found, "steps": steps,
            "a_ops": [c.op for c in trail_a.calls if not _is_view(c)],
            "b_ops": [c.op for c in trail_b.calls if not _is_view(c)]}


def _setup(*sides: Side) -> list[str]:
    """Python lines a repro runs first so that its process selects the kernels the engines ran (e.g. vLLM's
    batch-invariant mode replaces aten kernels process-wide); from the runners' `repro_setup`."""
    lines: list[str] = []
    for side in sides:
        for line in getattr(side.runner, "repro_setup", None) or []:
            if line not in lines:
                lines.append(line)
    return lines


# -- the kind of difference at the first divergent operator ---------------------------------------------------
@dataclass
class OperatorDifference:
    """What the search found at the first divergent operator, on the recorded calls (tic.harness.locate.replay's kinds):
    the operator whose value for the traced token the other side never computes, the engine side that runs it,
    what differs, and for an argument that differs, where each side's value of it came from."""

    kind: str  # replay.SAME_ARGUMENTS | replay.ARGUMENTS_DIFFER | replay.SEQUENCES_DIFFER
    operator: str
    side: str  # the engine side ("A" or "B") whose call computes the new value
    detail: str  # sides named as the engine sides
    argument: int | str | None = None  # the first differing argument (ARGUMENTS_DIFFER): index or keyword
    origins: dict | None = None  # engine side -> where its value of that argument came from
    paired_by: str | None = None  # how the other side's call was paired with this one (`counterpart`)
    # engine side -> {"operator", "call" (1-based, in its trail), "args"}: the paired calls, or for different
    # operator sequences each side's own first call whose value the other side never computes
    calls: dict | None = None


def _op_side(trail: Trail, ci: int, where: dict, rows: int):
    return repro_mod.OpSide(trail.calls[ci], where, rows, token_parts(trail, trail.calls[ci]))


def _entry(trail: Trail, ci: int, where: dict) -> dict:
    """A call as tic.harness.locate.replay compares calls."""
    call = trail.calls[ci]
    return {"op": call.op, "args": call.args, "kwargs": call.kwargs, "where": where, "layouts": call.layouts,
            "launch": getattr(call.func, "launch_spec", None), "token_args": token_parts(trail, call)}


def _origin(trail: Trail, ci: int, key) -> str:
    """Where argument `key` (index or keyword) of call ci came from: an earlier call of the trail, the module's
    input, or outside the recorded calls (a weight, a buffer, a constant)."""
    call = trail.calls[ci]
    src_args, src_kwargs = call.sources if call.sources is not None else ((None,) * len(call.args), {})
    src = src_args[key] if isinstance(key, int) else src_kwargs.get(key)
    one = lambda x: isinstance(x, tuple) and len(x) == 2 and all(isinstance(i, int) for i in x)  # noqa: E731
    if src is not None and not one(src):  # a list argument: the first of its tensors that a call produced
        src = next((x for x in src if x is not None and one(x)), None)
    if src is not None:
        producer = trail.calls[src[0]]
        base = next((i for i, a in enumerate(producer.args) if isinstance(a, torch.Tensor)), None)
        if _is_view(producer) and base is not None:
            return f"a view ({producer.op}, call {src[0] + 1}) of {_origin(trail, src[0], base)}"
        return f"output {src[1]} of call {src[0] + 1} ({producer.op})"
    part = token_parts(trail, call)[0][key] if isinstance(key, int) else None
    return "the module's input" if _flat(part) else "outside the module's recorded calls (a weight, buffer or constant)"


def _only(ops: list[str], other: list[str], most: int = 8) -> list[str]:
    """Operators of one side that the other side never runs, in order, once each."""
    seen, out = set(other), []
    for op in ops:
        if op not in seen and op not in out:
            out.append(op)
    return out[:most] + (["..."] if len(out) > most else [])


def _unpaired(trail_ref: Trail, trail_new: Trail, found: dict, most: int = 4) -> list[str]:
    """Why each of the reference side's calls of the found operator is not its counterpart (`counterpart`): it
    records no value for the traced token (e.g. an output written into a buffer the recorder maps to no token), a
    value of another size, or the same bits."""
    outs_ref, _ = trail_rows(trail_ref)
    outs_new, _ = trail_rows(trail_new)
    k = found["b_where"].get("output", 0)
    value = next((v for kk, _, v, _ in outs_new[found["b_call"]] if kk == k), None)
    why = []
    for ci, call in enumerate(trail_ref.calls):
        if call.op != found["op"]:
            continue
        got = [v for kk, _, v, _ in outs_ref[ci] if kk == k]
        if not outs_ref[ci]:
            reason = "no value for the traced token in any output"
        elif not got:
            reason = f"no value for the traced token in output {k}"
        elif value is not None and got[0].numel() != value.numel():
            reason = f"output {k} holds {got[0].numel()} elements of the traced token, not {value.numel()}"
        elif value is not None and _key(got[0]) == _key(value):
            reason = f"output {k} holds the same bits"
        else:
            reason = f"output {k} differs, on other arguments, at another rank"
        why.append(f"call {ci + 1} ({_describe_args(call)}): {reason}")
    return why[:most] + ([f"{len(why) - most} more"] if len(why) > most else [])


def operator_difference(found: dict, trail_ref: Trail, trail_new: Trail, ref_side: str,
                        new_side: str) -> OperatorDifference:
    """The kind of difference between the first divergent call (on `new_side`) and its counterpart; without a
    counterpart, also the other side's own first call whose value `new_side` never computes."""
    op = found["op"]
    calls = {new_side: {"operator": op, "call": found["b_call"] + 1, "args": found["b_args"]}}
    if found["a_call"] is None:
        if found["a_value"] is not None:
            detail = f"side {ref_side} has no such conversion: its value is the operator's input"
        else:
            other = first_operator(trail_new, trail_ref)["found"]
            count = lambda t: sum(1 for c in t.calls if c.op == op)  # noqa: E731
            detail = (f"side {ref_side} has no call to pair with it: no {op} on the same arguments for the traced "
                      f"token, and no call of this step at the same rank (side {ref_side} runs {op} "
                      f"{count(trail_ref)} times, side {new_side} {count(trail_new)})")
            why = _unpaired(trail_ref, trail_new, found)
            if why:
                detail += f"; side {ref_side}'s {op} calls: {'; '.join(why)}"
            if other is not None:
                calls[ref_side] = {"operator": other["op"], "call": other["b_call"] + 1, "args": other["b_args"]}
                detail += (f"; side {ref_side}'s own first value that side {new_side} never computes comes from "
                           f"{other['op']} (its call {other['b_call'] + 1})")
            ops = {side: [c.op for c in t.calls if not _is_view(c)]
                   for side, t in ((ref_side, trail_ref), (new_side, trail_new))}
            only = {side: _only(ops[side], ops[o]) for side, o in ((ref_side, new_side), (new_side, ref_side))}
            detail += "".join(f"; operators only side {side} runs: {', '.join(names)}"
                              for side, names in sorted(only.items()) if names)
        return OperatorDifference(replay.SEQUENCES_DIFFER, op, new_side, detail, calls=calls)
    calls[ref_side] = {"operator": op, "call": found["a_call"] + 1, "args": found["a_args"]}
    entries = {ref_side: _entry(trail_ref, found["a_call"], found["a_where"]),
               new_side: _entry(trail_new, found["b_call"], found["b_where"])}
    d = replay.difference(entries["A"], entries["B"])  # replay names the two calls by their engine sides
    origins = None
    if d["kind"] == replay.ARGUMENTS_DIFFER and d["argument"] is not None:
        origins = {ref_side: _origin(trail_ref, found["a_call"], d["argument"]),
                   new_side: _origin(trail_new, found["b_call"], d["argument"])}
    return OperatorDifference(d["kind"], op, new_side, d["detail"], d["argument"], origins, found.get("paired_by"),
                              calls)


# -- the locator ------------------------------------------------------------------------------------------
@dataclass
class Finding:
    """What `locate` found for one compared sequence; tic.harness.locate.report renders it (locate.json, the
    chart, report.md). Fields that a search which stopped earlier never reached stay None."""

    gate: str
    side_a: str  # the sides' labels
    side_b: str
    compared_through_response_position: int
    logprob_a: float | None  # each side's logprob at that position, as its rerun gave it
    logprob_b: float | None
    reproduced_gate_values: bool | None  # whether those are the very bits the gate measured (None: not given)
    layers: list[dict]  # per stage, in order: compare_rows' figures, "stage" and "first_divergent"
    first_divergent_layer: str | None
    status: str = ""
    culprit_module: str | None = None
    traced_position: int | None = None  # the culprit's first differing position, whose operators are traced
    first_operator: str | None = None
    operator_args: dict | None = None  # "a"/"b": each side's call of it, described
    operator_side: str | None = None  # the engine side whose call computes the value the other never has
    operator_calls: dict | None = None  # engine side -> its call index in its trail (None: no such call)
    difference: OperatorDifference | None = None
    implementations: dict | None = None  # "a"/"b": each side's operators, when the sequences differ
    recording_errors: list[str] | None = None
    # one entry per level descended: {"module", "diverges_on_identical_inputs", "siblings": [{"module",
    # "diverges", "max_ulp"}]}
    module_trail: list[dict] = field(default_factory=list)
    operator_trail: list[dict] = field(default_factory=list)  # the new side's steps: {"op", "args", "equal"}
    operators_a: list[str] = field(default_factory=list)
    operators_b: list[str] = field(default_factory=list)
    repro: str | None = None  # the emitted script
    repro_check: dict | None = None  # its fresh run (tic.harness.locate.repro), or why nothing was emitted
    repro_proves: str | None = None  # what the emitted repro shows, as its fresh run decided
    forward_passes: int = 0
    seconds: float = 0.0
    run_changes: str | None = None  # what this run changed from the configuration (tic locate --eager)


class _Runs:
    """Both sides' capture runs of one search, counting the forward passes they cost."""

    def __init__(self, side_a: Side, side_b: Side):
        self.a, self.b, self.forwards = side_a, side_b, 0

    def run(self, side: Side, spec: CaptureSpec) -> Capture:
        cap = side.run(spec)
        self.forwards += cap.forwards
        return cap


def compare_stages(stages: list[str], cap_a: Capture, cap_b: Capture) -> tuple[list[dict], str | None]:
    """Each stage's rows on both sides, in order, and the first divergent stage: the first that differs after the
    last stage that agrees. A difference that a later stage no longer shows did not reach the output: the two
    models place an operation in different modules (Gemma's embedding scale: inside transformers' embedding,
    after vLLM's), so its stage is reported as differing but the search starts after it."""
    table = [{"stage": s, **compare_rows(cap_a.outputs.get(s, {}), cap_b.outputs.get(s, {})), "first_divergent": False}
             for s in stages]
    differs = [not r["equal"] and r["positions"] > 0 for r in table]
    agree = [i for i, r in enumerate(table) if r["equal"] and r["positions"] > 0]
    first = next((i for i in range(agree[-1] + 1 if agree else 0, len(table)) if differs[i]), None)
    if first is None:  # nothing differs after the last agreeing stage: the earliest difference, if any
        first = next((i for i, d in enumerate(differs) if d), None)
    if first is None:
        return table, None
    table[first]["first_divergent"] = True
    return table, table[first]["stage"]


def descend(runs: _Runs, runner: CaptureRunner, cap_a: Capture, first: str) -> tuple[str | None, list[dict], dict]:
    """From the first divergent stage down to the module that still differs on side A's inputs: (that module, or
    None when the stage itself agrees on them; the levels descended; each replayed module's comparison).

    One replay per level: feeding a parent and its children at once would hide the parent's own arithmetic
    (e.g. attention between q_proj and o_proj), while siblings cannot mask each other."""
    iso: dict[str, dict] = {}

    def replay_level(level: list[str]) -> None:
        spec = CaptureSpec(outputs=set(level), replace={n: cap_a.inputs[n] for n in level if n in cap_a.inputs})
        cap_r = runs.run(runs.b, spec)
        for n in level:
            iso[n] = compare_rows(cap_a.outputs.get(n, {}), cap_r.outputs.get(n, {}))

    def called_kids(n: str) -> set[str]:
        """n's nearest descendants that ran: a child never called itself (a container such as an experts list
        whose members a fused forward calls directly) stands for its own children."""
        got = set()
        for c in runner.children(n):
            got |= {c} if cap_a.outputs.get(c) else called_kids(c)
        return got

    diverges = lambda n: iso[n]["positions"] > 0 and not iso[n]["equal"]  # noqa: E731
    replay_level([first])
    if not diverges(first):
        return None, [], iso
    node, descent = first, [{"module": first, "diverges_on_identical_inputs": True, "siblings": []}]
    while True:
        near = called_kids(node)
        kids = [c for c in cap_a.order if c in near]
        if kids:
            replay_level(kids)
        descent[-1]["siblings"] = [{"module": c, "diverges": diverges(c), "max_ulp": iso[c]["max_ulp"]} for c in kids]
        nxt = next((c for c in kids if diverges(c)), None)
        if nxt is None:
            return node, descent, iso
        node = nxt
        descent.append({"module": node, "diverges_on_identical_inputs": True, "siblings": []})


def trace_operator(runs: _Runs, cap_a: Capture, culprit: str, pos: int) -> tuple[Capture, Capture, dict | None, bool]:
    """Both sides' operator trails inside the culprit at position `pos` (side B fed side A's inputs) and the first
    divergent operator: (trail capture A, trail capture B, first_operator's answer, whether the first new value is
    side A's)."""
    repl = {culprit: cap_a.inputs[culprit]} if culprit in cap_a.inputs else {}
    ta = runs.run(runs.a, CaptureSpec(outputs={culprit}, trail_module=culprit, trail_position=pos))
    tb = runs.run(runs.b, CaptureSpec(outputs={culprit}, replace=repl, trail_module=culprit, trail_position=pos))
    trail_info = first_operator(ta.trail, tb.trail) if ta.trail and tb.trail else None
    fwd = trail_info and trail_info["found"]
    if trail_info and (not fwd or fwd.get("counterpart_inputs_shared") is False):
        # every value side B computes is also one of side A's, or side B's first new value comes from an
        # operator whose side A counterpart already had other inputs: the first new value is on side A
        # (a step only side A takes, e.g. a rounding), so look from side A's operators instead
        rev = first_operator(tb.trail, ta.trail)
        if rev["found"]:
            rev["a_ops"], rev["b_ops"] = rev["b_ops"], rev["a_ops"]
            if fwd and fwd.get("a_call") is not None:
                rev["forward"] = fwd  # why the forward pairing was given up, for the report
            return ta, tb, rev, True
    return ta, tb, trail_info, False


def _name_operator(f: Finding, ta: Capture, tb: Capture, trail_info: dict | None, new_on_a: bool) -> dict | None:
    """The finding's operator fields from the traced trails; the first divergent call's description (or None)."""
    t_ref, t_new = (tb, ta) if new_on_a else (ta, tb)
    ref_side, new_side = ("B", "A") if new_on_a else ("A", "B")
    errs = [e for t in (ta.trail, tb.trail) if t for e in t.errors]
    f.recording_errors = errs[:10] or None
    found = trail_info and trail_info["found"]
    f.status = "localized" if found else "localized to a module; operator not resolved"
    if not found:
        return None
    f.first_operator = found["op"]
    args_ref, args_new = found.get("a_args"), found["b_args"]
    f.operator_args = {"a": args_new, "b": args_ref} if new_on_a else {"a": args_ref, "b": args_new}
    f.operator_side = new_side
    # each engine side's call index in its trail (None: that side has no such call), for recheck_repro
    f.operator_calls = {ref_side: found["a_call"], new_side: found["b_call"]}
    f.difference = operator_difference(found, t_ref.trail, t_new.trail, ref_side, new_side)
    fwd = trail_info.get("forward")
    if fwd is not None and f.difference.kind == replay.SEQUENCES_DIFFER:
        names = _argument_names(ta.trail.calls[fwd["a_call"]], fwd.get("unshared_arguments") or [])
        f.difference.detail += (
            f"; side B's own {fwd['op']} (its call {fwd['b_call'] + 1}) pairs with side A's call "
            f"{fwd['a_call'] + 1} ({fwd.get('paired_by')}), but that call's traced input"
            + (f" in {names} is a value side B never has" if names else "s are values side B never has"))
    return found


def _argument_names(call, keys: list) -> str:
    """Arguments of a recorded call by index or keyword, with their schema names where the operator has one."""
    names = replay.argument_names({"op": call.op})
    return ", ".join(f"argument {k} ({names[k]})" if isinstance(k, int) and k < len(names) else f"argument {k}"
                     for k in keys)


def _emit_repro(f: Finding, runs: _Runs, out_dir: Path, ta: Capture, tb: Capture, found: dict, new_on_a: bool) -> None:
    """The minimal repro of the first divergent operator (or, for different operator sequences, of the culprit
    module), verified in a fresh process; its outcome into the finding."""
    culprit, pos, diff = f.culprit_module, f.traced_position, f.difference
    setup = _setup(runs.a, runs.b)
    if diff.kind == replay.SEQUENCES_DIFFER and found["a_value"] is None:
        progs = [_module_program(t, culprit, pos) for t in (ta, tb)]
        if not all(progs):
            f.status += ("; no repro: the module's output is not produced by a recorded operator (a kernel "
                         "launched through an entry point that tic.harness.locate.launch_record does not register)")
            return
        info = repro_mod.emit_module(out_dir, f.gate, culprit, progs[0], progs[1], f.side_a, f.side_b,
                                     f"{found['op']} in {culprit}: {diff.kind}", setup=setup)
    else:
        # the repro names its entries by engine side, whichever side has the new value
        t_ref, t_new = (tb, ta) if new_on_a else (ta, tb)
        ref = None if found["a_call"] is None else _op_side(t_ref.trail, found["a_call"], found["a_where"],
                                                            found["a_rows"])
        new = _op_side(t_new.trail, found["b_call"], found["b_where"], found["b_rows"])
        info = repro_mod.emit(out_dir, f.gate, ref, new, found["a_value"], f.side_a, f.side_b,
                              f"{found['op']} in {culprit}: {diff.kind}", setup=setup, new_side=f.operator_side)
    f.repro = info["script"]
    f.repro_check = {k: v for k, v in info.items() if k != "script"}
    f.repro_proves = info.get("proves") if info.get("script") else None


def locate(side_a: Side, side_b: Side, out_dir: Path, gate: str, upto: int, expected: dict | None = None,
           emit_repro: bool = True) -> Finding:
    """Run the whole loop for one compared sequence, through response position `upto`. A repro is written to
    out_dir; the report is tic.harness.locate.report's (write)."""
    t0 = time.perf_counter()
    runs = _Runs(side_a, side_b)
    runner = side_a.runner
    stages = runner.stages()
    names = set(stages)
    for s in (n for n in stages if ".layers." in n):
        names |= set(runner.descendants(s))
    cap_a = runs.run(side_a, CaptureSpec(outputs=set(names), inputs=set(names)))
    cap_b = runs.run(side_b, CaptureSpec(outputs=set(names)))
    lp_a, lp_b = (None if v is None else float(v) for v in (cap_a.logprobs.get(upto), cap_b.logprobs.get(upto)))
    # the rerun must give the very bits the gate measured, or the localisation is of something else
    reproduced = (lp_a == expected.get("a") and lp_b == expected.get("b")) if expected else None
    layers, first = compare_stages(stages, cap_a, cap_b)
    f = Finding(gate, side_a.label, side_b.label, upto, lp_a, lp_b, reproduced, layers, first)
    if first is None:
        differ = lp_a is not None and lp_b is not None and not rows_equal((cap_a.logprobs[upto],),
                                                                           (cap_b.logprobs[upto],))
        f.status = "divergence after the head: log-softmax" if differ else "no divergence"
        f.culprit_module = "log_softmax" if differ else None
    else:
        f.culprit_module, f.module_trail, iso = descend(runs, runner, cap_a, first)
        if f.culprit_module is None:
            f.status = (f"upstream: {first} agrees when fed side A's per-token inputs, so the difference comes "
                        "from its other inputs (mask, cache)")
        else:
            f.traced_position = iso[f.culprit_module]["first_position"]
            ta, tb, trail_info, new_on_a = trace_operator(runs, cap_a, f.culprit_module, f.traced_position)
            found = _name_operator(f, ta, tb, trail_info, new_on_a)
            if found and f.difference.kind == replay.SEQUENCES_DIFFER and found["a_value"] is None:
                f.status = f"localized: {f.difference.kind} in {f.culprit_module}: {f.difference.detail}"
                f.implementations = {"a": trail_info["a_ops"][:40], "b": trail_info["b_ops"][:40]}
            if found and emit_repro:
                _emit_repro(f, runs, out_dir, ta, tb, found, new_on_a)
            if trail_info:
                f.operator_trail = trail_info["steps"][:80]
                f.operators_a, f.operators_b = trail_info["a_ops"][:80], trail_info["b_ops"][:80]
    f.forward_passes = runs.forwards
    f.seconds = round(time.perf_counter() - t0, 3)
    return f


def recheck_repro(side_a: Side, side_b: Side, found: Finding, changed: str, out_dir: Path) -> dict:
    """Re-run the repro `locate` emitted (`found` is its result) after side `changed` ("A", "B", or "AB" for both)
    was changed, e.g. a fix applied or a planted fault removed: that side's computation is recorded again, on the
    same module inputs (side B is fed side A's, as in `locate`) at the same traced position, and replaces that
    side's entry in the repro's tensors; the other side's entry stays as emitted, and the emitted script is run on
    them in a fresh process. Exit 0: the two sides now give the same bits there; 1: they still differ.

    The changed side's new entry is, for an operator repro, the counterpart of the other side's call (the same
    step: operator and traced value shapes, at the same rank, as `first_operator` pairs them); for a module
    repro, the module's recorded operator sequence. When the repro has no call for one side (its value was the
    input of a conversion only the other side runs), the changed side no longer runs that operator, or both sides
    changed, both sides' module sequences as recorded now are compared instead ("module"), by a newly rendered
    module repro."""
    check = found.repro_check or {}
    if not found.repro or not check.get("tensors"):
        raise TicInputError("no emitted repro to recheck")
    changed = changed.upper()  # "A", "B", or "AB": both sides changed (a kernel planted on both, removed)
    culprit, pos = found.culprit_module, found.traced_position
    ta = side_a.run(CaptureSpec(outputs={culprit}, inputs={culprit}, trail_module=culprit, trail_position=pos))
    repl = {culprit: ta.inputs[culprit]} if culprit in ta.inputs else {}
    tb = side_b.run(CaptureSpec(outputs={culprit}, replace=repl, trail_module=culprit, trail_position=pos))
    fresh = {"A": ta, "B": tb}
    data = torch.load(check["tensors"], weights_only=False)
    key = changed.lower()  # the repro's entries are named by engine side
    other_key = "b" if key == "a" else "a"
    other = other_key.upper()
    entry = None
    if changed == "AB":  # nothing of the emitted repro stays: both sides' modules as computed now
        pass
    elif data[key] is not None and "calls" in data[key]:
        entry, kind = _module_program(fresh[changed], culprit, pos), "module"
    elif data[key] is not None and data[other_key] is not None and fresh[changed].trail and fresh[other].trail:
        entry, kind = _counterpart_call(fresh[other].trail, found.operator_calls[other], data[other_key],
                                        fresh[changed].trail, data[key].get("cut")), "operator"
    if entry is None:  # compare the two sides' whole module as computed now
        progs = [_module_program(fresh[s], culprit, pos) for s in ("A", "B")]
        if not all(progs):
            return {"kind": "module", "exit_code": None, "output": "the module's output is not produced by a "
                    "recorded torch operator: nothing to replay"}
        res = repro_mod.emit_module(out_dir, found.gate, culprit, progs[0], progs[1], found.side_a, found.side_b,
                                    f"{culprit} rechecked after side {changed} changed", setup=_setup(side_a, side_b))
        return {"kind": "module", "exit_code": res["exit_code"], "output": res["output"]}
    data[key] = entry
    res = repro_mod.rerun(Path(found.repro), data, out_dir)
    return {"kind": kind, **res}


def _counterpart_call(trail_other: Trail, index: int, other_entry: dict, trail_new: Trail,
                      cut: dict | None = None) -> dict | None:
    """A repro entry for trail_new's call that is the counterpart of trail_other's call `index` (the same step:
    operator and traced value shapes, at the same rank, as `first_operator` pairs them), picking the same output,
    cut as the entry it replaces was (`cut`: its rows, so that a row-count-dependent kernel is compared on the
    same launch); None if there is none."""
    outs_other, _ = trail_rows(trail_other)
    outs_new, _ = trail_rows(trail_new)
    op = other_entry["op"]
    if index is None or index >= len(trail_other.calls) or trail_other.calls[index].op != op \
            or not outs_other[index]:
        return None
    kind = _step_kind(trail_other, outs_other, index)
    rank = sum(1 for ci in range(index) if outs_other[ci] and _step_kind(trail_other, outs_other, ci) == kind)
    same_op = [ci for ci, got in enumerate(outs_new) if got and _step_kind(trail_new, outs_new, ci) == kind]
    if rank >= len(same_op):
        return None
    ci = same_op[rank]
    got = outs_new[ci]
    k, where, _v, rows = next((g for g in got if g[0] == other_entry["where"]["output"]), got[0])
    side = _op_side(trail_new, ci, where, rows)
    args, kwargs, where = repro_mod.cut_call(side, cut)
    with torch.inference_mode():
        expect = repro_mod._run(side, args, kwargs, where).detach().clone()
    return {**_entry(trail_new, ci, where), "args": args, "kwargs": kwargs, "expect": expect}  # as emit keeps one


# -- gate recipes -----------------------------------------------------------------------------------------
def _expected(fm: dict, a: str, b: str) -> dict:
    return {"a": fm.get(a), "b": fm.get(b)}


def sides_for_gate(ctx, gate_id: str, measured) -> tuple[Side, Side, int, dict | None]:
    fm = measured.metrics.get("first_mismatch") if measured is not None else None
    if not fm:
        raise TicInputError(f"{gate_id} reports no first mismatch: nothing to localise")
    sp = ctx.sampling
    if gate_id in ("C4", "C5"):
        eng = ctx.live_rollout_engine(f"locating {gate_id}")
        samples = ctx.rollout_samples()
        s, j = fm["sequence"], fm["position"]
        ra = runner_for(eng, sp.temperature)
        side_a = Side(f"rollout decode ({eng.name}, KV cache, one token per step)", ra,
                      lambda spec: ra.decode(samples, s, j, spec))
        other = eng if gate_id == "C4" else ctx.train_engine()
        if other.dumped_samples() is not None:
            raise TicInputError(f"locating {gate_id} needs a live train engine, not a dump")
        rb = ra if other is eng else runner_for(other, sp.temperature)
        what = "rollout prefill scoring" if gate_id == "C4" else "train recompute"
        side_b = Side(f"{what} ({other.name}, teacher-forced forward)", rb, lambda spec: rb.score(samples, s, spec))
        return side_a, side_b, j, _expected(fm, "rollout", "train")
    if gate_id == "C3":
        eng = ctx.live_rollout_engine("locating C3")
        prompts, p, size, at, j = ctx.prompts, fm["probe"], fm["batch_size"], fm["index_in_batch"], fm["position"]
        alone = eng.generate_together([prompts[p]], sp, [p])
        bp, bids, _ = probe_batch(prompts, p, size, at)  # the batch exactly as gates/c3.py builds it
        batch = eng.generate_together(bp, sp, bids)
        batch[at] = alone[0]  # identical tokens up to the compared position; the probe is teacher-forced
        r = runner_for(eng, sp.temperature)
        side_a = Side("probe decoded alone (batch of 1)", r, lambda spec: r.decode(alone, 0, j, spec, together=True))
        side_b = Side(f"probe decoded in a batch of {size} at index {at}", r,
                      lambda spec: r.decode(batch, at, j, spec, together=True))
        return side_a, side_b, j, _expected(fm, "alone", "batched")
    if gate_id == "C6":
        samples, s, j = ctx.rollout_samples(), fm["sequence"], fm["position"]
        ref, var = ctx.train_engine(), ctx.train_layout_engine(fm["layout"])
        ra, rb = runner_for(ref, sp.temperature), runner_for(var, sp.temperature)
        side_a = Side("train recompute, reference layout", ra, lambda spec: ra.score(samples, s, spec))
        side_b = Side(f"train recompute, layout {describe_train_layout(fm['layout'])}", rb,
                      lambda spec: rb.score(samples, s, spec))
        return side_a, side_b, j, _expected(fm, "rollout", "train")
    raise TicInputError(f"no locator recipe for gate {gate_id} (C3, C4, C5, C6)")


def locate_for_gate(ctx, gate_id: str, measured, strict: bool = False, run_changes: str | None = None) -> dict:
    """What the runner calls when C3/C4/C5 fail: localise the gate's first mismatch, return the findings.

    When the comparison cannot be rerun (a dump, an engine without capture, no first mismatch) the gate's
    verdict must still stand: the reason goes into the findings, unless `strict` (tic locate) asks to fail.
    run_changes: what the caller changed from the configuration for this run, kept in the report."""
    try:
        side_a, side_b, upto, expected = sides_for_gate(ctx, gate_id, measured)
    except TicInputError as e:
        if strict:
            raise
        return {"status": f"not localised: {e}"}
    out_dir = ctx.artifacts(gate_id) / "locate"
    finding = locate(side_a, side_b, out_dir, gate_id, upto, expected)
    finding.run_changes = run_changes
    return report.gate_summary(report.write(finding, out_dir))
