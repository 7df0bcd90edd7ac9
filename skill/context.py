"""What a gate sees: the config, lazily built engines, and data shared along one ladder run.

Engines and rollout samples are built once per run and reused (C4 and C5 compare against the same rollout).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tic.config.schema import EngineConfig, TicConfig
from tic.core.env import env_overlay
from tic.core.errors import TicInputError
from tic.harness.engines import build_engine
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.kernels.vllm_provider import require_vllm
from tic.harness.measure.prompts import file_prompts, random_prompts
from tic.harness.model.facts import ModelFacts, vocab_size
from tic.harness.model import generate
from tic.skill.state import LadderState


def _kv_cache_dtype(options: dict) -> str:
    return {"fp8_e4m3": "fp8", None: "auto"}.get(options.get("kv_cache_dtype"), options.get("kv_cache_dtype"))


def check_kernels(cfg: TicConfig) -> None:
    for side in ("rollout", "train"):
        c = getattr(cfg, side)
        kv = _kv_cache_dtype(c.options)
        if c.engine == "vllm" or kv == "auto":
            continue  # vLLM checks its own options
        if kv != "fp8":
            raise TicInputError(f"{side}.options.kv_cache_dtype {kv!r}: tic's kernels model auto and fp8 (e4m3)")
        if c.kernels not in ("vllm", "consistent"):
            # stock HF keeps K/V in the model dtype whatever the option says: C2 and C7 would model a round trip
            # the forward does not make
            raise TicInputError(f"{side}.options.kv_cache_dtype {kv!r} needs {side}.kernels vllm or consistent "
                                f"(kernels {c.kernels} keep K/V in the model dtype)")
    if cfg.train.kernels in ("vllm", "consistent") and cfg.rollout.engine in ("vllm", "hf") and \
            _kv_cache_dtype(cfg.rollout.options) != _kv_cache_dtype(cfg.train.options):
        # the training forward's K/V must make the rollout's cache round trip (tic.harness.kernels.vllm_fp8)
        raise TicInputError(f"train.options.kv_cache_dtype {_kv_cache_dtype(cfg.train.options)!r} differs from "
                            f"rollout.options.kv_cache_dtype {_kv_cache_dtype(cfg.rollout.options)!r}; set both alike")
    for side in ("rollout", "train"):
        c = getattr(cfg, side)
        if c.kernels == "vllm" and c.engine == "hf" and side == "rollout":
            raise TicInputError("rollout: kernels: vllm runs prefill-style training forwards only; for a vLLM "
                                "rollout use rollout: {engine: vllm}")
        if c.kernels == "vllm" and c.engine in ("hf", "megatron"):
            try:
                require_vllm(c.device, load=False)  # the rollout engine sets vLLM's mode before it is imported
            except TicInputError as e:
                raise TicInputError(f"{side}: {e}") from None


class GateContext:
    def __init__(self, cfg: TicConfig):
        check_kernels(cfg)  # refuse what this machine cannot run before anything is written
        self.cfg = cfg
        self.state = LadderState(cfg.state_path)
        self._engines: dict[str, Engine] = {}
        self._rollout: list[Sample] | None = None
        self._train: list | None = None

    def with_config(self, cfg: TicConfig) -> "GateContext":
        """A context on another config that records into this one's state directory (C9's scale-up stages)."""
        other = GateContext(cfg)
        other.state = self.state
        return other

    # -- model ------------------------------------------------------------------------------------------
    @cached_property
    def model_source_dir(self) -> Path:
        """The configured model directory (config.json; weights may be generated elsewhere)."""
        if self.cfg.model is None:
            raise TicInputError("this gate needs a model: add 'model: {path: DIR}' to tic.yaml")
        d = self.cfg.resolve(self.cfg.model.path)
        if not d.is_dir():
            raise TicInputError(f"model directory not found: {d}")
        return d

    @cached_property
    def model_config(self) -> dict:
        return generate.read_model_config(self.model_source_dir)

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.model_config)

    @cached_property
    def model(self) -> ModelFacts:
        """The model under test as engines load it (its weights generated on first use)."""
        self.model_source_dir  # noqa: B018 - the clear error when tic.yaml has no model
        return ModelFacts(generate.resolve_model_dir(self.cfg), self.cfg.model.dtype, self.model_config)

    @cached_property
    def model_hash(self) -> str:
        return generate.model_hash(self.model.dir)

    # -- inputs -----------------------------------------------------------------------------------------
    @property
    def sampling(self) -> Sampling:
        s = self.cfg.sampling
        return Sampling(s.temperature, s.max_tokens, s.seed)

    @cached_property
    def prompts(self) -> list[list[int]]:
        p = self.cfg.prompts
        if p.source == "file":
            return file_prompts(self.cfg.resolve(p.file), self.vocab_size)
        return random_prompts(p.count, self.vocab_size, p.min_len, p.max_len, p.seed)

    # -- engines ----------------------------------------------------------------------------------------
    def _rollout_kernels(self) -> RolloutKernels:
        """What a training side on vLLM's kernels must match of the configured rollout (its KV page size and the
        logprob rule of the runner vLLM picked), its engine built first if it is not yet: a live vLLM engine as it
        resolved them, a dump as its options say (vLLM's defaults where they do not)."""
        if self.cfg.rollout.engine not in ("vllm", "dump"):
            return RolloutKernels()
        return self.rollout_engine().rollout_kernels

    def _build(self, side: str, side_cfg: EngineConfig, shared_model: bool = True) -> Engine:
        model = None if side_cfg.engine == "dump" else self.model  # a dump reads no model
        return build_engine(side, side_cfg, model, self.cfg.resolve, shared_model, self._rollout_kernels)

    def side_engine(self, name: str, side: str, side_cfg: EngineConfig, env: dict[str, str] | None = None) -> Engine:
        """The engine `name` for one side's config, built once per run (under `env`, when given): the train
        layouts C6 compares, the baseline and consistent rollouts of C1/C10."""
        if name not in self._engines:
            with env_overlay(env or {}):
                self._engines[name] = self._build(side, side_cfg)
        return self._engines[name]

    def engine(self, side: str) -> Engine:
        return self.side_engine(side, side, getattr(self.cfg, side))

    def rollout_engine(self) -> Engine:
        return self.engine("rollout")

    def train_engine(self) -> Engine:
        return self.engine("train")

    def train_layout_engine(self, changes: dict) -> Engine:
        """The train engine with some layout fields changed (C6); the model itself is shared."""
        if self.cfg.train.engine == "dump":
            raise TicInputError("C6 needs a live train engine (hf), not a dump")
        return self.side_engine("train " + repr(sorted(changes.items())), "train",
                                self.cfg.train.model_copy(update=changes))

    def private_engine(self, side: str, gate: str) -> Engine:
        """A live engine whose model no other gate shares (C8/C9 update its weights)."""
        side_cfg = getattr(self.cfg, side)
        if side_cfg.engine == "dump":
            raise TicInputError(f"{gate} needs a live {side} engine, not a dump")
        return self._build(side, side_cfg, shared_model=False)

    def require_live(self, side: str, gate: str) -> None:
        if getattr(self.cfg, side).engine == "dump":
            raise TicInputError(f"{gate} needs a live {side} engine (hf{' or vllm' if side == 'rollout' else ''}), "
                                "not a dump")

    def live_rollout_engine(self, gate: str) -> Engine:
        eng = self.rollout_engine()
        if eng.dumped_samples() is not None:
            raise TicInputError(f"{gate} needs a live rollout engine (hf or vllm), not a dump")
        return eng

    # -- data shared along the run ------------------------------------------------------------------------
    def rollout_samples(self) -> list[Sample]:
        """The rollout every comparison starts from: a dump's records, or one live sampling pass."""
        if self._rollout is None:
            eng = self.rollout_engine()
            dumped = eng.dumped_samples()
            if dumped is not None:
                self._rollout = dumped
            else:
                self._rollout = eng.generate(self.prompts, self.sampling, list(range(len(self.prompts))))
        return self._rollout

    def train_logprobs(self) -> list:
        """The train engine's recompute of the rollout, in its configured layout (C5 and C6 share it)."""
        if self._train is None:
            self._train = self.train_engine().score(self.rollout_samples(), self.sampling)
        return self._train

    def artifacts(self, gate: str) -> Path:
        d = self.state.artifacts_dir(gate)
        d.mkdir(parents=True, exist_ok=True)
        return d
