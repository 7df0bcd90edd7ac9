"""Parallel layouts on CPU: rank processes over gloo, and the expert-merge rule that makes EP degree invisible.

The rule (method 4.5): expert parallel only moves data. Every (token, top-k slot) pair travels to the rank
that owns its expert, the expert's output travels back unchanged, and the token's owning rank sums the
weighted outputs in fp32 in top-k slot order. Nothing in that sum depends on how many ranks hold experts or
which rank answers first, so EP=1 and EP=N give the same bits.

`slot_order_allgather` keeps the same merge over an all-gather / reduce-scatter exchange (the shape of
vLLM's default EP backend): each rank writes its experts' outputs into a per-slot buffer [tokens, k, D]
that is zero elsewhere, and the cross-rank sum of that buffer has exactly one non-zero term per element,
so it only moves data (x + 0 = x); the owning rank then merges in slot order.

`rank_partials` is the merge many stacks use instead (vLLM's all-gather/reduce-scatter EP path works this
way): every rank sums the weighted outputs of the experts it holds, and the partial sums are added across
ranks in the model dtype. The association of that sum follows the expert placement, so it changes with EP.
It is kept as the planted fault the tests and C5 must catch.

Tensor parallel is here only to show what it does (a row-parallel linear all-reduces partial products);
C0 refuses it.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tic.core.errors import TicInputError
from tic.harness.kernels.coverage import expert_weights, router_routing

COMBINES = ("slot_order", "slot_order_allgather", "rank_partials")


# -- what the method covers ---------------------------------------------------------------------------------
COVERED = ("data parallel (requests split), expert parallel whose exchange only moves data and whose merge is "
           "an fp32 sum on the token's owning rank in top-k slot order, training context parallel (KV "
           "concatenated); TP = 1 and no decode context parallel")


SLOT_ORDER_PATCH = "moe-slot-order-sum"  # the bundled vLLM patch that merges expert outputs by this rule


def layout_refusals(side: str, parallel, options: dict | None = None, engine: str = "hf",
                    patches: list[str] | tuple = ()) -> list[str]:
    """Why a side's layout is outside the method: every cross-rank reduction on the compared path."""
    out = []
    if parallel.tp > 1:
        out.append(f"{side}.parallel.tp={parallel.tp}: TP>1 puts an all-reduce of partial sums on the compared "
                   "path (its algorithm and order follow message size and rank count)")
    if parallel.dcp > 1:
        out.append(f"{side}.parallel.dcp={parallel.dcp}: decode context parallel merges attention partials "
                   "across ranks (a reduction on the compared path)")
    exchange = os.environ.get("VLLM_ALL2ALL_BACKEND") or "allgather_reducescatter"
    if engine == "vllm" and parallel.ep > 1 and exchange not in ("allgather_reducescatter", "naive"):
        out.append(f"{side}.parallel.ep={parallel.ep} on vLLM with VLLM_ALL2ALL_BACKEND={exchange}: the covered "
                   "expert exchange is allgather_reducescatter (every rank merges the same gathered tokens); "
                   f"{exchange} merges each rank's own tokens, which the {SLOT_ORDER_PATCH} patch does not cover")
    if engine == "vllm" and parallel.ep > 1 and SLOT_ORDER_PATCH not in patches:
        out.append(f"{side}.parallel.ep={parallel.ep} on vLLM without the {SLOT_ORDER_PATCH} patch: each rank sums "
                   "its own experts' outputs and the partial sums are reduce-scattered across ranks, an order that "
                   f"follows the EP degree; add {side}.patches: [{SLOT_ORDER_PATCH}]")
    if parallel.ep > 1 and (options or {}).get("expert_combine") == "rank_partials":
        out.append(f"{side}.options.expert_combine={options['expert_combine']}: expert partial sums reduced "
                   "across ranks follow the EP degree; merge on the owning rank in slot order")
    return out


# -- the arithmetic both sides share ---------------------------------------------------------------------
def expert_owners(num_experts: int, ep: int) -> torch.Tensor:
    """Rank (inside its EP group) holding each expert: contiguous blocks, as vLLM and Megatron place them."""
    return torch.tensor([e * ep // num_experts for e in range(num_experts)], dtype=torch.long)


def route(router, x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of [N, D] tokens: (weights [N, k] in x's dtype, expert ids [N, k]).
    fp32 softmax, top-k, optional renormalisation. rowwise: one token per call (batch-invariant)."""
    top_k, norm = router.top_k, getattr(router, "norm_topk_prob", True)

    def one(r):
        probs = torch.softmax(F.linear(r, router.weight), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, top_k, dim=-1)
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    if not rowwise or x.shape[0] == 0:
        return one(x)
    parts = [one(r) for r in x.split(1, dim=0)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def expert_output(experts, e: int, x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """One expert's SwiGLU MLP on [n, D] rows (unweighted), in x's dtype."""
    gate_up, down = expert_weights(experts)

    def one(r):
        gate, up = F.linear(r, gate_up[e]).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, down[e])

    if not rowwise or x.shape[0] <= 1:
        return one(x)
    return torch.cat([one(r) for r in x.split(1, dim=0)])


def combine_slot_order(outs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """THE RULE: out[t] = sum over slots s = 0..k-1, in that order, of fp32(outs[t, s] * weights[t, s]) (the
    product in the model dtype), accumulated in fp32 from zero and rounded to the model dtype once.
    outs [N, k, D] (expert outputs as they came back, unweighted), weights [N, k] (any float dtype)."""
    N, k, D = outs.shape
    acc = torch.zeros(N, D, dtype=torch.float32)
    for s in range(k):
        acc = acc + (outs[:, s] * weights[:, s, None].to(outs.dtype)).to(torch.float32)
    return acc.to(outs.dtype)


# -- expert parallel over a process group ----------------------------------------------------------------
class ExpertParallelMoE:
    """Forward of one HF sparse-MoE block (router `gate`, stacked `experts`) with its experts split over an
    EP group. Tokens stay on the rank that holds them (their DP rank); only expert work moves."""

    def __init__(self, block, group, ep: int, combine: str = "slot_order", rowwise: bool = True):
        if combine not in COMBINES:
            raise ValueError(f"unknown expert combine {combine!r} (known: {', '.join(COMBINES)})")
        self.block, self.group, self.ep, self.combine, self.rowwise = block, group, ep, combine, rowwise
        # a block driven by tic's kernel modules (kernels: consistent) routes and runs experts with its
        # provider, so EP = 1 here is bit for bit that provider's own moe_experts
        ops = getattr(block, "_tic_ops", None)
        if getattr(ops, "quant", None) is not None:  # its rows would run the unquantized experts
            raise TicInputError("expert parallel ranks of the hf engine do not run block-FP8 experts yet")
        self.provider = getattr(ops, "provider", None) if hasattr(getattr(ops, "provider", None),
                                                                  "moe_expert_rows") else None
        gate = getattr(block, "gate", None)
        rule = getattr(block, "_tic_routing", None) or (router_routing(gate) if isinstance(gate, nn.Module) else None)
        if rule is not None and not rule.plain:  # route() and the provider call below take a softmax top-k
            raise TicInputError(f"expert parallel ranks of the hf engine route softmax top-k routers only, not "
                                f"{rule.describe()}; run this model with parallel.ep 1")
        self.me = dist.get_rank(group) if ep > 1 else 0
        self.owners = expert_owners(block.gate.weight.shape[0], ep)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.provider is not None:
            router = self.block.gate
            logits = self.provider.linear(x, router.weight)
            w, idx = self.provider.moe_route(logits, router.top_k, getattr(router, "norm_topk_prob", True))
        else:
            w, idx = route(self.block.gate, x, self.rowwise)
        merge = {"slot_order": self._slot_order, "slot_order_allgather": self._slot_order_allgather,
                 "rank_partials": self._rank_partials}[self.combine]
        return merge(x, w, idx).reshape(shape)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ex = self.block.experts
        if self.provider is not None:
            return self.provider.moe_expert_rows(x, e, *expert_weights(ex))
        return expert_output(ex, e, x, self.rowwise)

    def _compute_local(self, x: torch.Tensor, experts_of_rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        for e in experts_of_rows.unique().tolist():
            m = experts_of_rows == e
            y[m] = self._expert(e, x[m])
        return y

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """All-to-all that only moves rows: send[i] goes to the rank its block of send_counts names."""
        if self.ep == 1:
            return send.clone()
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        return recv

    def _slot_order(self, x, w, idx):
        N, k = idx.shape
        owner = self.owners[idx].flatten()  # pair p = token * k + slot
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.ep)
        recv_counts = self._exchange(send_counts, [1] * self.ep, [1] * self.ep)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        rows = self._exchange(x[order // k], sc, rc)
        experts = self._exchange(idx.flatten()[order], sc, rc)
        back = self._exchange(self._compute_local(rows, experts), rc, sc)
        outs = torch.empty(N * k, x.shape[-1], dtype=x.dtype)
        outs[order] = back
        return combine_slot_order(outs.view(N, k, x.shape[-1]), w)

    def _gather_tokens(self, *tensors) -> tuple[list[int], list[torch.Tensor]]:
        """All-gather dispatch: every rank sees every rank's tokens (row counts first, rows padded to the max)."""
        N = tensors[0].shape[0]
        if self.ep == 1:
            return [N], list(tensors)
        n = torch.tensor([N])
        counts_t = [torch.zeros_like(n) for _ in range(self.ep)]
        dist.all_gather(counts_t, n, group=self.group)
        counts = [int(c) for c in counts_t]
        return counts, [self._gather_padded(t, max(counts), counts) for t in tensors]

    def _slot_order_allgather(self, x, w, idx):
        N, k = idx.shape
        counts, (xs, ids) = self._gather_tokens(x, idx)
        slots = torch.zeros(xs.shape[0], k, xs.shape[-1], dtype=x.dtype)
        mine = self.owners[ids] == self.me
        for e in ids[mine].unique().tolist():
            t, s = (ids == e).nonzero(as_tuple=True)
            slots[t, s] = self._expert(e, xs[t])
        if self.ep > 1:
            dist.all_reduce(slots, group=self.group)  # one non-zero term per element: data movement only
        start = sum(counts[:self.me])
        return combine_slot_order(slots[start:start + N], w)

    def _rank_partials(self, x, w, idx):
        """Planted: all-gather the tokens, each rank sums its own experts' weighted outputs, all-reduce."""
        N, k = idx.shape
        counts, (xs, ws, ids) = self._gather_tokens(x, w, idx)
        partial = torch.zeros(xs.shape[0], xs.shape[-1], dtype=torch.float32)
        for s in range(k):
            mine = (self.owners[ids[:, s]] == self.me).nonzero().flatten()
            for e in ids[mine, s].unique().tolist():
                rows = mine[ids[mine, s] == e]
                h = self._expert(e, xs[rows])
                partial[rows] += (h * ws[rows, s, None].to(h.dtype)).to(torch.float32)
        partial = partial.to(x.dtype)
        if self.ep > 1:
            dist.all_reduce(partial, group=self.group)
        start = sum(counts[:self.me])
        return partial[start:start + N]

    def _gather_padded(self, t: torch.Tensor, pad: int, counts: list[int]) -> torch.Tensor:
        buf = torch.zeros((pad, *t.shape[1:]), dtype=t.dtype)
        buf[:t.shape[0]] = t
        parts = [torch.empty_like(buf) for _ in range(self.ep)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])


def moe_blocks(model) -> list:
    """The model's sparse-MoE blocks in execution order (router `gate` with top_k, stacked `experts`)."""
    return [m for m in model.modules()
            if hasattr(m, "gate") and hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")
            and hasattr(m.gate, "weight") and hasattr(m.gate, "top_k")]


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """What TP does to a linear (o_proj, down_proj): each rank multiplies its slice of the input features
    and the partial products are all-reduced in the activation dtype. Shown, not supported (C0 refuses)."""
    tp = dist.get_world_size(group)
    r = dist.get_rank(group)
    cols = weight.shape[1] // tp
    part = F.linear(x[..., r * cols:(r + 1) * cols], weight[:, r * cols:(r + 1) * cols])
    dist.all_reduce(part, group=group)
    return part


# -- rank processes ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ep_group(rank: int, world: int, ep: int):
    """The EP group holding `rank`: consecutive blocks of ep ranks. Every rank must create every group."""
    if ep == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            mine = g
    return mine


def require_gpus(what: str, n: int) -> None:
    """A layout of n GPU ranks needs n GPUs on this machine."""
    have = torch.cuda.device_count()
    if have < n:
        raise TicInputError(f"{what} needs {n} GPUs; this machine has {have}")


def rank_gpu(rank: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry for a rank process that drives one GPU: the rank-th of the GPUs this
    process was given (a scheduler's list, UUIDs included), or GPU `rank` when none was set."""
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return str(rank)
    if rank >= len(given):
        raise TicInputError(f"rank {rank} needs a GPU of its own; CUDA_VISIBLE_DEVICES gives this process "
                            f"{len(given)}")
    return given[rank]


def _answer(rank: int, fn, stage: str = "") -> tuple:
    """("ok", fn()) or its failure as it crosses back to the caller: bad input stays bad input."""
    try:
        return "ok", fn()
    except TicInputError as e:
        return "input", f"rank {rank}: {e}"
    except Exception as e:  # noqa: BLE001 - any failure is reported, never a hang
        return "err", f"rank {rank}{stage}: {type(e).__name__}: {e}\n{traceback.format_exc()}"


def _rank_main(rank, world, port, conn, setup, setup_args, threads, timeout_s, backend):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if threads:
        torch.set_num_threads(threads)

    def start():
        if backend:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        return setup(rank, world, *setup_args) if setup else {}

    status, state = _answer(rank, start, " setup")
    conn.send_bytes(pickle.dumps((status, None) if status == "ok" else (status, state)))
    if status != "ok":
        return
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if msg is None:
            break
        fn, args = msg
        res = _answer(rank, lambda: fn(state, *args))
        try:
            blob = pickle.dumps(res)
        except Exception as e:  # noqa: BLE001 - a result that cannot leave the process is an error, not a hang
            blob = pickle.dumps(("err", f"rank {rank}: result not picklable: {type(e).__name__}: {e}"))
        conn.send_bytes(blob)
    if backend:
        dist.destroy_process_group()


class RankPool:
    """`world` spawned processes joined by a gloo process group on 127.0.0.1, kept for repeated calls.

    setup(rank, world, *setup_args) builds each rank's state once; call(fn, per_rank_args) runs
    fn(state, *args) on every rank at once (fn must be importable) and returns the results in rank order.
    Every wait is bounded: a rank that dies or hangs ends the pool with an error instead of a stuck test.
    backend=None: no process group (the ranks' own library, e.g. vLLM, builds its groups); daemon=False lets a
    rank start processes of its own (close() still ends the ranks)."""

    def __init__(self, world: int, setup: Callable | None = None, setup_args: tuple = (),
                 timeout_s: float = 300.0, threads: int | None = None, backend: str | None = "gloo",
                 daemon: bool = True):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, daemon=daemon,
                            args=(r, world, port, child, setup, setup_args, threads, timeout_s, backend))
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(setup=True)

    ERROR_GRACE_S = 5.0  # after one rank's error, how long the others get to come back before the pool ends

    def _collect(self, setup: bool = False) -> list:
        """Every rank's answer, in rank order. Ranks are read as they answer. One rank's error ends the wait for
        the others after ERROR_GRACE_S (they may be stuck in a collective for the rank that failed): if every
        rank came back the pool stays usable (a failed locator capture leaves the engine to later gates), else
        it ends. A failed setup always ends it."""
        n = len(self.conns)
        deadline = time.monotonic() + self.timeout_s
        answers: dict[int, tuple] = {}
        first_bad = None
        while len(answers) < n:
            waiting = [r for r in range(n) if r not in answers]
            ready = [r for r in waiting if self.conns[r].poll(0)]
            for r in ready:
                answers[r] = pickle.loads(self.conns[r].recv_bytes())
                if answers[r][0] != "ok" and first_bad is None:
                    first_bad = answers[r]
                    deadline = min(deadline, time.monotonic() + self.ERROR_GRACE_S)
            if ready:
                continue
            dead = [r for r in waiting if not self.procs[r].is_alive() and not self.conns[r].poll(0)]
            if dead or time.monotonic() > deadline:
                code = self.procs[dead[0]].exitcode if dead else None
                self.close()
                if first_bad is not None:
                    self._raise(first_bad)
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited (code {code}) without answering")
                raise RuntimeError(f"rank {waiting[0]} did not answer within {self.timeout_s:.0f} s")
            mp_connection.wait([self.conns[r] for r in waiting], timeout=0.2)
        if first_bad is not None:
            if setup:
                self.close()
            self._raise(first_bad)
        return [answers[r][1] for r in range(n)]

    @staticmethod
    def _raise(answer: tuple):
        status, value = answer
        if status == "input":  # bad input met inside a rank stays bad input (one line, exit 2)
            raise TicInputError(value)
        raise RuntimeError(value)

    def call(self, fn: Callable, per_rank_args: list[tuple]) -> list:
        if not self.procs:
            raise RuntimeError("rank pool is closed")
        for c, args in zip(self.conns, per_rank_args):
            c.send_bytes(pickle.dumps((fn, tuple(args))))
        return self._collect()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
