"""Engine factory: config side ('rollout' | 'train') -> engine. vLLM is imported only when asked for."""

from __future__ import annotations

from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE
from tic.core.errors import TicInputError

__all__ = ["Engine", "Sample", "Sampling", "build_engine"]


def engine_class(side_cfg) -> type[Engine]:
    """The engine class a side config names, without building it (vLLM is imported lazily by its module)."""
    if side_cfg.engine == "hf":
        from tic.harness.engines.hf import HFEngine

        return HFEngine
    if side_cfg.engine == "vllm":
        from tic.harness.engines import vllm

        return vllm.VLLMEngine
    from tic.harness.engines.dump import DumpEngine

    return DumpEngine


def rollout_kv_block_size(ctx) -> int:
    """The KV page size of the configured rollout as vLLM resolved it, its engine built first if it is not yet: a
    training side on vLLM's kernels pages its prefill K/V alike (FA3 picks its key tile from the paging). vLLM's
    default for a rollout that is not a vLLM engine (a dump)."""
    if ctx.cfg.rollout.engine != "vllm":
        return DEFAULT_KV_BLOCK_SIZE
    return ctx.rollout_engine().kv_block_size


def build_engine(ctx, side: str, side_cfg=None, shared_model: bool = True) -> Engine:
    """shared_model=False: the engine gets a model object of its own (hf; C8/C9 change its weights)."""
    side_cfg = side_cfg if side_cfg is not None else getattr(ctx.cfg, side)
    if side_cfg.engine == "dump":
        from tic.harness.engines.dump import DumpEngine

        return DumpEngine(ctx.cfg.resolve(side_cfg.dump), side)
    par = side_cfg.parallel
    if side_cfg.engine == "hf":
        from tic.harness.engines.hf_ranks import RankedHFEngine, check_options

        check_options(side_cfg.options)
        if par.tp > 1 or par.cp > 1 or par.dcp > 1:
            raise TicInputError(f"{side}.parallel: the hf engine runs data and expert parallel ranks only "
                                f"(tp={par.tp}, cp={par.cp}, dcp={par.dcp}); C0 says which layouts are covered")
        # (a rollout side on vLLM's kernels is refused before any engine is built: tic.skill.context.check_kernels)
        kv_block_size = rollout_kv_block_size(ctx) if side_cfg.kernels == "vllm" and side != "rollout" \
            else DEFAULT_KV_BLOCK_SIZE
        if par.dp > 1 or par.ep > 1:  # rank processes: CPU (gloo, DP and EP) or one GPU each (DP)
            return RankedHFEngine.from_config(side_cfg, ctx.model_dir, ctx.dtype, kv_block_size)
        from tic.harness.engines.hf import HFEngine

        return HFEngine.from_config(side_cfg, ctx.model_dir, ctx.dtype, shared_model, kv_block_size)
    if side_cfg.engine == "vllm":
        if side != "rollout":
            raise TicInputError("vllm is a rollout engine; use train.engine: hf or dump")
        if par.dp > 1:  # one rank process per DP rank, each with its own in-process engine
            from tic.harness.engines.vllm_ranks import RankedVLLMEngine

            return RankedVLLMEngine.from_config(side_cfg, ctx)
        try:
            from tic.harness.engines.vllm import VLLMEngine
        except ImportError as e:
            raise TicInputError(f"rollout.engine is vllm but vLLM cannot be imported ({e}); "
                                "install tic[vllm] on a GPU machine") from None
        return VLLMEngine.from_config(side_cfg, ctx)
    raise TicInputError(f"{side}.engine: unknown engine {side_cfg.engine!r}")
