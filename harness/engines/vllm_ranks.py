"""vLLM on several GPUs: one rank process per data-parallel rank, each holding tic's in-process vLLM engine.

Two layouts, both as RL rollouts run them:
- `dp > 1, ep = 1`: independent replicas, one GPU each (CUDA_VISIBLE_DEVICES). A request lives on one replica
  and no collective touches it. (vLLM's own coupled DP would shard every MoE expert over the DP ranks as
  tensor parallel, an all-reduce on the compared path; replicas avoid that.)
- `ep = dp * tp` (tp = 1): vLLM's offline SPMD data parallel (VLLM_DP_RANK/SIZE/MASTER_IP/PORT) with
  `enable_expert_parallel`: attention per rank, the experts split over the ranks, tokens all-gathered into
  every MoE layer and the outputs reduce-scattered back. The ranks step together (vLLM runs dummy batches on a
  rank without work), so every rank makes the same sequence of generate calls: a rank with fewer requests
  runs placeholder requests whose outputs are dropped.

Requests are dealt round-robin (request i on rank i % dp), the same rule as the hf rank engine; every sample
records its rank and the layout.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from pathlib import Path
from typing import Callable

import torch

from tic.config.schema import EngineConfig
from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_text
from tic.harness.model.facts import ModelFacts
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.engines.parallel import RankPool, free_port, rank_gpu, require_gpus
from tic.harness.engines.ranks import DealtRequests
from tic.harness.engines.vllm import VLLMEngine


# -- inside each rank ----------------------------------------------------------------------------------------
def _setup_rank(rank: int, world: int, engine_kwargs: dict, spmd: bool, master_port: int, engine_path: str) -> dict:
    record = engine_kwargs["options"].get("record")
    if record:  # one record file per rank (ranks write at once)
        p = Path(record)
        engine_kwargs = {**engine_kwargs, "options": {**engine_kwargs["options"],
                                                      "record": str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))}}
    if spmd:
        os.environ.update({"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank), "VLLM_DP_SIZE": str(world),
                           "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(master_port)})
    else:  # a replica sees only its own GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = rank_gpu(rank)
    import importlib

    module, cls = engine_path.split(":")
    engine = getattr(importlib.import_module(module), cls)(**engine_kwargs)
    return {"engine": engine, "rank": rank, "spmd": spmd}


def _info(state: dict) -> dict:
    eng = state["engine"]
    return {"fingerprint": eng.fingerprint(), "rollout_kernels": eng.rollout_kernels,
            "max_num_seqs": eng.max_num_seqs, "vllm_version": eng.vllm_version, "patches": list(eng.patches),
            "batch_invariant": eng.batch_invariant, "process_environment": eng.process_environment()}


def _turns(state: dict, calls: list[tuple[list, list]], turns: int, run) -> list:
    """Run this rank's calls, then placeholder turns until it has taken `turns` turns (SPMD lockstep)."""
    out = []
    for items, ids in calls:
        out += run(items, ids)
    for _ in range(turns - len(calls) if state["spmd"] else 0):
        state["engine"].take_turn()
    return out


def _generate_rank(state: dict, calls: list, turns: int, sampling: Sampling) -> list[Sample]:
    eng = state["engine"]
    out = _turns(state, calls, turns, lambda prompts, ids: eng.generate_together(prompts, sampling, ids))
    for s in out:
        s.meta["rank"] = state["rank"]
    return out


def _score_rank(state: dict, calls: list, turns: int, sampling: Sampling) -> list[torch.Tensor]:
    eng = state["engine"]
    return _turns(state, calls, turns, lambda samples, _ids: eng.score(samples, sampling))


# -- work on the owner rank (the locator's reruns) -----------------------------------------------------------
def _owner_call(state: dict, job: tuple | None, release: str):
    """The owner rank runs job = (fn, args) on its engine. In SPMD lockstep the other ranks keep taking turns
    (their MoE layers serve the owner's tokens; each of their turns pairs with one generate call of the owner)
    until they have taken as many as the owner: when done, the owner writes its count, one more than it has
    taken, to `release`, then takes that last turn with them. Replicas just wait."""
    eng = state["engine"]
    start = eng.turns
    if job is None:
        while state["spmd"]:
            eng.take_turn()
            if os.path.exists(release) and int(Path(release).read_text()) == eng.turns - start:
                break
        return None
    fn, args = job
    try:
        return fn(eng, *args)
    finally:
        if state["spmd"]:
            atomic_write_text(Path(release), str(eng.turns - start + 1))
            eng.take_turn()


# -- in the calling process ----------------------------------------------------------------------------------
class RankedVLLMEngine(DealtRequests, Engine):
    """Same interface as VLLMEngine for generation and scoring; the work runs on dp rank processes."""

    name = "vllm"
    switch_keys, switch_env = VLLMEngine.switch_keys, VLLMEngine.switch_env  # C1/C10: the same switch as one engine

    def __init__(self, engine_kwargs: dict, dp: int, ep: int = 1, tp: int = 1, timeout_s: float = 900.0,
                 engine_path: str = "tic.harness.engines.vllm:VLLMEngine"):
        """engine_kwargs: VLLMEngine's arguments except the layout; engine_path: the engine class each rank
        builds (tests put a stand-in there)."""
        if tp != 1:
            raise TicInputError(f"rollout.parallel.tp={tp}: tic's vLLM ranks run TP = 1 (C0: TP > 1 is not covered)")
        if ep not in (1, dp):
            raise TicInputError(f"rollout.parallel.ep={ep}: vLLM's expert parallel spans all DP x TP ranks "
                                f"(ep = {dp} here, or 1 for independent replicas)")
        if torch.cuda.is_available():  # (rank engines that need no GPU stand in for vLLM in CPU tests)
            require_gpus(f"rollout.parallel.dp={dp}", dp)
        self.dp, self.ep, self.spmd = dp, ep, ep > 1
        self.layout = f"DP{dp} EP{ep}" if self.spmd else f"DP{dp} (replicas)"
        kwargs = {**engine_kwargs, "dp": dp if self.spmd else 1, "ep": ep, "tp": 1}
        self.pool = RankPool(dp, _setup_rank, (kwargs, self.spmd, free_port(), engine_path), timeout_s=timeout_s,
                             backend=None, daemon=False)
        weakref.finalize(self, self.pool.close)
        info = self.pool.call(_info, [()] * dp)
        first = info[0]
        self.batch_size = int(engine_kwargs.get("batch_size", 8))
        self.vllm_version, self.patches = first["vllm_version"], first["patches"]
        self.batch_invariant, self.rollout_kernels = first["batch_invariant"], first["rollout_kernels"]
        self.kv_block_size = self.rollout_kernels.kv_block_size
        self.max_num_seqs = first["max_num_seqs"]
        self._fingerprint = {**first["fingerprint"], "parallel": self.layout}
        self._process_environment = first["process_environment"]
        # what a training provider in this process must match: its bundled patches (it applies TIC_PATCHES, as
        # every vLLM process of the rollout does); the page size and logprob rule it is handed (rollout_kernels above)
        from tic import patches as tic_patches

        os.environ[tic_patches.ENV_VAR] = ",".join(self.patches)

    @classmethod
    def from_config(cls, side_cfg: EngineConfig, model: ModelFacts,
                    resolve: Callable[[Path], Path]) -> "RankedVLLMEngine":
        kwargs = VLLMEngine.config_kwargs(side_cfg, model, resolve)
        # engine_process: own (C1/C10 ask it of each side, so that patches and modes stay per side) is what a rank
        # process is already; in it the engine runs inline (module hooks for the locator need the model there)
        kwargs["options"] = {**kwargs["options"], "engine_process": "inline"}
        p = side_cfg.parallel
        return cls(kwargs, p.dp, p.ep, p.tp)

    def _calls(self, items: list, ids: list, chunk: int) -> tuple[list[list[int]], list, int]:
        """Each rank's share in generate calls of at most `chunk` items, and the turns every rank takes."""
        shares = self._deal(items)
        calls = [[([items[i] for i in s[j:j + chunk]], [ids[i] for i in s[j:j + chunk]])
                  for j in range(0, len(s), chunk)] for s in shares]
        return shares, calls, max(1, *(len(c) for c in calls))

    def _generate(self, prompts, sampling: Sampling, request_ids, chunk: int) -> list[Sample]:
        shares, calls, turns = self._calls(list(prompts), list(request_ids), chunk)
        res = self.pool.call(_generate_rank, [(c, turns, sampling) for c in calls])
        out = self._gather(shares, res, len(prompts))
        for s in out:
            s.meta["layout"] = self.layout
        return out

    def generate(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        return self._generate(prompts, sampling, request_ids, self.batch_size)

    def generate_together(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        """One global batch: each DP rank runs its share of it as one batch."""
        return self._generate(prompts, sampling, request_ids, max(1, len(prompts)))

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        shares, calls, turns = self._calls(list(samples), [s.id for s in samples], self.batch_size)
        res = self.pool.call(_score_rank, [(c, turns, sampling) for c in calls])
        return self._gather(shares, res, len(samples))

    def fingerprint(self) -> dict:
        return dict(self._fingerprint)

    def process_environment(self) -> dict:
        return dict(self._process_environment)

    def on_owner(self, items: list, index: int, fn, args: tuple = (), forwards: int = 1):
        """(see DealtRequests.on_owner; the ranks step in turns, whatever `forwards` is)"""
        owner, jobs = self._owner_jobs(items, index, fn, args)
        with tempfile.TemporaryDirectory(prefix="tic-owner-") as d:
            release = os.path.join(d, "release")
            return self.pool.call(_owner_call, [(job, release) for job in jobs])[owner]

    def close(self) -> None:
        self.pool.close()
