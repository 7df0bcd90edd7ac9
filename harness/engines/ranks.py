"""What every engine that deals requests to rank processes shares: the dealing rule, gathering the results back
in request order, and running a function on the rank that owns a request (or on every rank) with the rank's
engine.

A request's rows never leave its rank (DP only decides where a request runs), so every number a gate compares
comes from one rank; whoever reruns a request (the locator) runs it there, through `on_owner`."""

from __future__ import annotations


class DealtRequests:
    """Request i of a call runs on rank i % dp (the engine sets `dp` and `pool`, a
    tic.harness.engines.parallel.RankPool)."""

    dp: int

    def owner_rank(self, index: int) -> int:
        """The DP rank that holds the index-th request of a call (its rows never leave it)."""
        return index % self.dp

    def _deal(self, items: list) -> list[list[int]]:
        return [[i for i in range(len(items)) if self.owner_rank(i) == r] for r in range(self.dp)]

    def on_every_rank(self, fn, *args) -> list:
        """fn(the rank's engine, *args) on every rank at once; the results in rank order."""
        return self.pool.call(_on_engine, [(fn, args)] * self.dp)

    def on_owner(self, items: list, index: int, fn, args: tuple = (), forwards: int = 1):
        """fn(the owner's engine, its share of `items`, the index of items[index] in that share, *args) on the rank
        that owns items[index], while the other ranks keep the layout's lockstep meanwhile; fn runs `forwards`
        forward passes there (ranks that exchange tokens inside each forward run as many). fn's result."""
        raise NotImplementedError(f"{type(self).__name__} does not run work on one owner rank")

    def _owner_jobs(self, items: list, index: int, fn, args: tuple) -> tuple[int, list]:
        """(the owner rank, each rank's job): (fn, (share, index in share, *args)) on the owner, None elsewhere."""
        shares = self._deal(items)
        owner = self.owner_rank(index)
        job = (fn, ([items[i] for i in shares[owner]], shares[owner].index(index), *args))
        return owner, [job if r == owner else None for r in range(self.dp)]

    @staticmethod
    def _gather(shares: list[list[int]], results: list[list], n: int) -> list:
        out: list = [None] * n
        for idx, res in zip(shares, results):
            if len(res) != len(idx):
                raise RuntimeError(f"a rank returned {len(res)} results for {len(idx)} requests")
            for i, x in zip(idx, res):
                out[i] = x
        return out


def _on_engine(state: dict, fn, args: tuple):
    return fn(state["engine"], *args)
