"""Engine factory: a side's config ('rollout' | 'train') -> engine. vLLM itself is imported only when a vLLM engine
is built (tic.harness.engines.vllm)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tic.config.schema import EngineConfig
from tic.core.errors import TicInputError
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.engines.dump import DumpEngine
from tic.harness.engines.hf import HFEngine
from tic.harness.engines.hf_ranks import RankedHFEngine, check_options
from tic.harness.engines.megatron import MegatronEngine  # megatron-core itself is imported when one is built
from tic.harness.engines.vllm import VLLMEngine
from tic.harness.engines.vllm_ranks import RankedVLLMEngine
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.model.facts import ModelFacts

__all__ = ["Engine", "Sample", "Sampling", "build_engine", "engine_class"]


def engine_class(side_cfg: EngineConfig) -> type[Engine]:
    """The engine class a side config names, without building it (vLLM is imported lazily by its module)."""
    if side_cfg.engine == "hf":
        return HFEngine
    if side_cfg.engine == "vllm":
        return VLLMEngine
    if side_cfg.engine == "megatron":
        return MegatronEngine
    return DumpEngine


def build_engine(side: str, side_cfg: EngineConfig, model: ModelFacts | None, resolve: Callable[[Path], Path],
                 shared_model: bool = True,
                 rollout_kernels: Callable[[], RolloutKernels] = RolloutKernels) -> Engine:
    """model: the model under test (None for a dump engine, which reads none). resolve: a path as tic.yaml
    writes it -> the file it names (TicConfig.resolve). shared_model=False: the engine gets a model object of its
    own (hf; C8/C9 change its weights). rollout_kernels: what a train side on vLLM's kernels must match of the
    rollout as vLLM resolved it (its KV page size and logprob rule), asked only for such a side and only after this
    side's own checks (a refused side starts no rollout engine)."""
    if side_cfg.engine == "dump":
        return DumpEngine(resolve(side_cfg.dump), side, side_cfg.options)
    assert model is not None, f"a live {side} engine needs the model under test"
    par = side_cfg.parallel
    if side_cfg.engine == "hf":
        check_options(side_cfg.options)
        if par.tp > 1 or par.cp > 1 or par.dcp > 1:
            raise TicInputError(f"{side}.parallel: the hf engine runs data and expert parallel ranks only "
                                f"(tp={par.tp}, cp={par.cp}, dcp={par.dcp}); C0 says which layouts are covered")
        # (a rollout side on vLLM's kernels is refused before any engine is built: tic.skill.context.check_kernels)
        rollout = rollout_kernels() if side_cfg.kernels == "vllm" and side != "rollout" else RolloutKernels()
        if par.dp > 1 or par.ep > 1:  # rank processes: CPU (gloo, DP and EP) or one GPU each (DP)
            return RankedHFEngine.from_config(side_cfg, model.dir, model.dtype, rollout)
        return HFEngine.from_config(side_cfg, model.dir, model.dtype, shared_model, rollout)
    if side_cfg.engine == "vllm":
        if side != "rollout":
            raise TicInputError("vllm is a rollout engine; use train.engine: hf or dump")
        if par.dp > 1:  # one rank process per DP rank, each with its own in-process engine
            return RankedVLLMEngine.from_config(side_cfg, model, resolve)
        return VLLMEngine.from_config(side_cfg, model, resolve)  # vLLM itself is imported when it is built
    if side_cfg.engine == "megatron":
        if side != "train":
            raise TicInputError("megatron is a train engine; use rollout.engine: hf or vllm")
        rollout = rollout_kernels() if side_cfg.kernels == "vllm" else RolloutKernels()
        return MegatronEngine.from_config(side_cfg, model.dir, model.dtype, shared_model, rollout)
    raise TicInputError(f"{side}.engine: unknown engine {side_cfg.engine!r}")
