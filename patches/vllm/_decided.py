"""Decisions a patch takes once per problem in a process, by a check it runs on seeded operands (which tile,
kernel or launch gives the reference bits), kept in a dict by problem key; and the eager run before each CUDA
graph capture that lets those checks see the graph's problems."""

from __future__ import annotations

from typing import Callable

# per decisions dict (by id, the dict held so its id stays its own): the keys first met while a graph was captured.
# Such a graph keeps the fallback for good, so these are what a capture without an eager run first costs.
_met_capturing: dict[int, tuple[dict, set]] = {}


def decided(taken: dict, key, decide: Callable[[], object], on_cuda: bool, while_capturing):
    """decide()'s result for key, run the first time key is seen and kept in taken. While a CUDA graph is being
    captured, an undecided key on the GPU gets while_capturing and stays undecided: deciding would launch work into
    the graph."""
    if key not in taken:
        import torch

        if on_cuda and torch.cuda.is_current_stream_capturing():
            _met_capturing.setdefault(id(taken), (taken, set()))[1].add(key)
            return while_capturing
        taken[key] = decide()
    return taken[key]


def counts(taken: dict, yes: str, no: str) -> dict[str, int]:
    """How many of the yes/no decisions taken so far went each way ({} before the first), and how many problems a
    graph captured before they were decided (`undecided_at_capture`, shown where any)."""
    agreed = sum(bool(v) for v in taken.values())
    out = {yes: agreed, no: len(taken) - agreed} if taken else {}
    late = len(_met_capturing.get(id(taken), (None, ()))[1])
    return {**out, "undecided_at_capture": late} if late else out


# vLLM's V1 model runner captures each graph size straight away by default (cudagraph_num_of_warmups = 0), so a
# check would first meet a decode graph's problems while capturing, and the graph would keep the fallback (the
# pinned tile, the reference GEMM tile) for good. One eager run of the size first lets every check run; its
# results are the same bits, so only speed changes. The V2 runner runs one already.
_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_warmup_and_capture")
_WARMUP = "tic-eager-run-before-capture"
_users: set[str] = set()


def _one_eager_run_first(original):
    def warmup_and_capture(self, *args, **kwargs):
        if len(args) < 5:  # num_warmups is the fifth parameter after self
            asked = kwargs.get("num_warmups")
            if asked is None:
                asked = self.compilation_config.cudagraph_num_of_warmups
            kwargs["num_warmups"] = max(1, asked)
        return original(self, *args, **kwargs)
    return warmup_and_capture


def with_eager_run_before_capture(name: str, hooks: dict) -> dict:
    """A patch's swap hooks (swap_hooks' dict) that also make vLLM run each graph size once eagerly before
    capturing it, while any patch so built is applied. A vLLM without that runner method is left alone."""
    from tic.patches._swap import restore_method, swap_method

    def apply() -> None:
        hooks["_apply"]()
        try:
            swap_method(*_RUNNER, _one_eager_run_first, _WARMUP)
        except (ImportError, AttributeError):
            return
        _users.add(name)

    def revert() -> None:
        hooks["_revert"]()
        _users.discard(name)
        if not _users:
            try:
                restore_method(*_RUNNER, _WARMUP)
            except (ImportError, AttributeError):
                pass

    return {**hooks, "_apply": apply, "_revert": revert}
