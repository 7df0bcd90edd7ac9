"""The hf engine spread over rank processes on CPU (gloo): the multi-GPU layouts CI can run.

Data parallel: requests are dealt to DP ranks round-robin; each rank samples or scores its own requests with
its own batches. Expert parallel: every MoE layer's experts are split over an EP group of consecutive ranks
and tokens travel to their experts and back (tic.harness.engines.parallel). A request's rows live on one rank, its
owner, so every number the gates compare comes from that rank.

Ranks run forward passes in lockstep: MoE layers exchange tokens inside each forward, so a rank with fewer
batches runs empty forwards through its MoE layers until every rank is done (as vLLM runs dummy batches).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from tic.config.schema import BackwardConfig
from tic.core.errors import TicInputError
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.engines.hf import HFEngine
from tic.harness.engines.ranks import DealtRequests
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.engines.parallel import (COMBINES, ExpertParallelMoE, RankPool, ep_group, moe_blocks, rank_gpu,
                                          require_gpus)

# kv_cache_dtype: kernels vllm, the rollout's (rollout.options.kv_cache_dtype): fp8 makes K/V take its FP8 round trip
OPTIONS = {"expert_combine": "slot_order", "kv_cache_dtype": "auto"}


def check_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TicInputError(f"options: unknown hf option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
    out = {**OPTIONS, **options}
    if out["kv_cache_dtype"] not in ("auto", "fp8", "fp8_e4m3"):
        raise TicInputError(f"options.kv_cache_dtype: {out['kv_cache_dtype']!r} (expected auto, fp8 or fp8_e4m3)")
    if out["expert_combine"] not in COMBINES:
        raise TicInputError(f"options.expert_combine: {out['expert_combine']!r} (expected one of "
                            f"{', '.join(COMBINES)})")
    return out


# -- inside each rank --------------------------------------------------------------------------------------
def _setup_rank(rank: int, world: int, engine_kwargs: dict, ep: int, combine: str) -> dict:
    import os

    if engine_kwargs.get("device", "cpu") != "cpu":  # a GPU rank sees its own GPU only (set before CUDA starts)
        os.environ["CUDA_VISIBLE_DEVICES"] = rank_gpu(rank)
    eng = HFEngine(**engine_kwargs)
    group = ep_group(rank, world, ep)
    # EP = 1: every rank holds every expert and runs the model's own MoE forward (DP only splits requests)
    blocks = moe_blocks(eng.model) if ep > 1 else []
    for b in blocks:
        b.forward = ExpertParallelMoE(b, group, ep, combine, rowwise=eng.kernels == "consistent")
    hidden = eng.model.config.get_text_config().hidden_size
    return {"engine": eng, "blocks": blocks, "hidden": hidden, "dtype": eng.model.dtype, "rank": rank}


def _lockstep(state: dict, own_forwards: int) -> int:
    """How many empty forwards this rank owes so every rank runs as many MoE exchanges."""
    n = torch.tensor([own_forwards])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n) - own_forwards


@torch.inference_mode()
def _idle(state: dict, forwards: int) -> None:
    empty = torch.empty(0, state["hidden"], dtype=state["dtype"])
    for _ in range(forwards):
        for b in state["blocks"]:
            b(empty)


def _generate_rank(state: dict, prompts: list, sampling: Sampling, ids: list, together: bool) -> list[Sample]:
    eng = state["engine"]
    batches = (1 if prompts else 0) if together else -(-len(prompts) // eng.batch_size)
    owed = _lockstep(state, batches * sampling.max_tokens)
    out = (eng.generate_together if together else eng.generate)(prompts, sampling, ids) if prompts else []
    _idle(state, owed)
    for s in out:
        s.meta["rank"] = state["rank"]
    return out


def _score_rank(state: dict, samples: list, sampling: Sampling) -> list[torch.Tensor]:
    eng = state["engine"]
    owed = _lockstep(state, -(-len(samples) // eng.micro_batch_size))
    out = eng.score(samples, sampling) if samples else []
    _idle(state, owed)
    return out


def _owner_call(state: dict, job: tuple | None, forwards: int):
    """The owner rank runs job = (fn, args) on its engine (`forwards` forward passes); the others serve their
    experts meanwhile."""
    owed = _lockstep(state, 0 if job is None else forwards)
    out = None
    if job is not None:
        fn, args = job
        out = fn(state["engine"], *args)
    _idle(state, owed)
    return out


# -- in the calling process --------------------------------------------------------------------------------
class RankedHFEngine(DealtRequests, Engine):
    """Same interface as HFEngine; the work runs on dp rank processes."""

    name = "hf"

    def __init__(self, model_dir: Path, dtype: str = "auto", kernels: str = "stock", attn: str = "sdpa",
                 batch_size: int = 8, micro_batch_size: int = 4, padding_side: str = "right",
                 packing: bool = False, dp: int = 1, ep: int = 1, options: dict | None = None,
                 timeout_s: float = 600.0, device: str = "cpu", order: str = "given",
                 rollout: RolloutKernels = RolloutKernels(), backward: BackwardConfig | None = None):
        opts = check_options(options or {})
        if dp % ep:
            raise TicInputError(f"parallel.ep={ep} must divide parallel.dp={dp} (hf ranks are DP ranks)")
        if device != "cpu":
            if ep > 1:
                raise TicInputError(f"parallel.ep={ep} with device {device}: hf expert parallel runs on CPU ranks "
                                    "(gloo); GPU ranks run data parallel only")
            require_gpus(f"parallel.dp={dp} with device {device}", dp)
        self.kernels, self.batch_size, self.micro_batch_size = kernels, batch_size, micro_batch_size
        self.dp, self.ep, self.combine = dp, ep, opts["expert_combine"]
        self.layout = f"DP{dp} EP{ep}" + (f" ({self.combine} merge)" if ep > 1 else "")
        kwargs = dict(model_dir=Path(model_dir), dtype=dtype, kernels=kernels, attn=attn, batch_size=batch_size,
                      micro_batch_size=micro_batch_size, padding_side=padding_side, packing=packing,
                      device="cuda" if device != "cpu" else "cpu", order=order, rollout=rollout,
                      backward=backward)
        self.pool = RankPool(dp, _setup_rank, (kwargs, ep, self.combine), timeout_s=timeout_s,
                             threads=torch.get_num_threads())
        weakref.finalize(self, self.pool.close)

    @classmethod
    def from_config(cls, side_cfg, model_dir: Path, dtype: str,
                    rollout: RolloutKernels = RolloutKernels()) -> "RankedHFEngine":
        p = side_cfg.parallel
        return cls(model_dir, dtype, side_cfg.kernels, side_cfg.attn_implementation, side_cfg.batch_size,
                   side_cfg.micro_batch_size, side_cfg.padding_side, side_cfg.packing, p.dp, p.ep,
                   side_cfg.options, device=getattr(side_cfg, "device", "cpu"),
                   order=getattr(side_cfg, "order", "given"), rollout=rollout,
                   backward=side_cfg.backward)

    def _generate(self, prompts, sampling, request_ids, together: bool) -> list[Sample]:
        shares = self._deal(prompts)
        args = [([prompts[i] for i in s], sampling, [request_ids[i] for i in s], together) for s in shares]
        out = self._gather(shares, self.pool.call(_generate_rank, args), len(prompts))
        for s in out:
            s.meta["layout"] = self.layout
        return out

    def generate(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        return self._generate(prompts, sampling, list(request_ids), together=False)

    def generate_together(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        """One global batch: each DP rank runs its share of it as one batch."""
        return self._generate(prompts, sampling, list(request_ids), together=True)

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        shares = self._deal(samples)
        args = [([samples[i] for i in s], sampling) for s in shares]
        return self._gather(shares, self.pool.call(_score_rank, args), len(samples))

    def on_owner(self, items: list, index: int, fn, args: tuple = (), forwards: int = 1):
        owner, jobs = self._owner_jobs(items, index, fn, args)
        return self.pool.call(_owner_call, [(job, forwards) for job in jobs])[owner]

    def close(self) -> None:
        self.pool.close()
