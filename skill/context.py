"""What a gate sees: the config, lazily built engines, and data shared along one ladder run.

Engines and rollout samples are built once per run and reused (C4 and C5 compare against the same rollout).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tic.config.schema import EngineConfig, TicConfig
from tic.core.env import env_overlay
from tic.core.errors import TicInputError
from tic.harness.engines import build_engine, engine_class
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE
from tic.harness.model.facts import ModelFacts, vocab_size
from tic.skill.state import LadderState


def check_kernels(cfg: TicConfig) -> None:
    for side in ("rollout", "train"):
        c = getattr(cfg, side)
        if c.kernels == "vllm" and c.engine == "hf" and side == "rollout":
            raise TicInputError("rollout: kernels: vllm runs prefill-style training forwards only; for a vLLM "
                                "rollout use rollout: {engine: vllm}")
        if c.kernels == "vllm" and c.engine == "hf":
            from tic.harness.kernels.vllm_provider import require_vllm

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
        from tic.harness.model.generate import read_model_config

        return read_model_config(self.model_source_dir)

    @cached_property
    def model_dir(self) -> Path:
        from tic.harness.model.generate import resolve_model_dir

        self.model_source_dir  # noqa: B018 - the clear error when tic.yaml has no model
        return resolve_model_dir(self.cfg)

    @cached_property
    def model_hash(self) -> str:
        from tic.harness.model.generate import model_hash

        return model_hash(self.model_dir)

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.model_config)

    @cached_property
    def model(self) -> ModelFacts:
        """What engines know of the model under test (its weights generated on first use)."""
        return ModelFacts(self.model_dir, self.cfg.model.dtype, self.model_config)

    # -- inputs -----------------------------------------------------------------------------------------
    @property
    def sampling(self) -> Sampling:
        s = self.cfg.sampling
        return Sampling(s.temperature, s.max_tokens, s.seed)

    @cached_property
    def prompts(self) -> list[list[int]]:
        from tic.harness.measure.prompts import file_prompts, random_prompts

        p = self.cfg.prompts
        if p.source == "file":
            return file_prompts(self.cfg.resolve(p.file), self.vocab_size)
        return random_prompts(p.count, self.vocab_size, p.min_len, p.max_len, p.seed)

    # -- engines ----------------------------------------------------------------------------------------
    def _rollout_kv_block_size(self) -> int:
        """The KV page size of the configured rollout as vLLM resolved it, its engine built first if it is not
        yet: a training side on vLLM's kernels pages its prefill K/V alike. vLLM's default for a rollout that is
        not a vLLM engine (a dump)."""
        if self.cfg.rollout.engine != "vllm":
            return DEFAULT_KV_BLOCK_SIZE
        return self.rollout_engine().kv_block_size

    def _build(self, side: str, side_cfg: EngineConfig | None = None, shared_model: bool = True) -> Engine:
        side_cfg = side_cfg if side_cfg is not None else getattr(self.cfg, side)
        model = None if side_cfg.engine == "dump" else self.model  # a dump reads no model
        # (a rollout side on vLLM's kernels is refused before any engine is built: check_kernels)
        on_vllm_kernels = side_cfg.engine == "hf" and side_cfg.kernels == "vllm" and side != "rollout"
        pages = self._rollout_kv_block_size() if on_vllm_kernels else DEFAULT_KV_BLOCK_SIZE
        return build_engine(side, side_cfg, model, self.cfg.resolve, shared_model, pages)

    def engine(self, side: str) -> Engine:
        if side not in self._engines:
            self._engines[side] = self._build(side)
        return self._engines[side]

    def rollout_engine(self) -> Engine:
        return self.engine("rollout")

    def train_engine(self) -> Engine:
        return self.engine("train")

    def train_layout_engine(self, changes: dict) -> Engine:
        """The train engine with some layout fields changed (C6); the model itself is shared."""
        key = "train " + repr(sorted(changes.items()))
        if key not in self._engines:
            if self.cfg.train.engine == "dump":
                raise TicInputError("C6 needs a live train engine (hf), not a dump")
            self._engines[key] = self._build("train", self.cfg.train.model_copy(update=changes))
        return self._engines[key]

    def private_engine(self, side: str, gate: str) -> Engine:
        """A live engine whose model no other gate shares (C8/C9 update its weights)."""
        if getattr(self.cfg, side).engine == "dump":
            raise TicInputError(f"{gate} needs a live {side} engine, not a dump")
        return self._build(side, shared_model=False)

    # -- C1/C10: the baseline and the consistent rollout ----------------------------------------------------
    @property
    def baseline_dir(self) -> Path:
        d = self.cfg.perf.baseline_dir
        return Path(self.cfg.resolve(d)) if d is not None else self.cfg.state_path / "baseline"

    @property
    def workload(self):
        from tic.harness.measure.perf import Workload

        p = self.cfg.perf
        return Workload(p.requests, p.input_len, p.output_len, p.concurrency, p.seed, self.cfg.sampling.temperature)

    def perf_side(self, which: str) -> tuple[Engine, dict[str, str]]:
        """('baseline' | 'consistent') -> (rollout engine, env vars it runs under). The baseline is the
        configured rollout with perf.baseline's changes (default: the engine's consistency switch off)."""
        r = self.cfg.rollout
        if r.engine == "dump":
            raise TicInputError("C1/C10 measure a live rollout engine, not a dump")
        common = engine_class(r).perf_changes(r)
        if common:
            r = EngineConfig.model_validate({**r.model_dump(), **common})
        if which == "consistent":
            side_cfg, env = r, dict(self.cfg.perf.consistent_env)
        else:
            changes = self.cfg.perf.baseline
            if changes is None:
                changes = engine_class(r).baseline_changes(r)  # from r, which holds what both sides need
            elif "options" in common and "options" in changes:  # a user's options keep what both sides need
                changes = {**changes, "options": {**common["options"], **changes["options"]}}
            try:
                side_cfg = EngineConfig.model_validate({**r.model_dump(), **changes})
            except ValueError as e:
                raise TicInputError(f"perf.baseline: {str(e).splitlines()[0]}") from None
            env = dict(self.cfg.perf.baseline_env)
        key = f"perf {which}"
        if key not in self._engines:
            with env_overlay(env):
                self._engines[key] = self._build("rollout", side_cfg)
        return self._engines[key], env

    # -- C9: a fresh process, and the scale-up stages --------------------------------------------------------
    def restore_in_fresh_process(self, checkpoint: Path, out_dir: Path, timeout_s: float = 1800) -> dict:
        """Run the first step after restoring `checkpoint` in a new Python process (tic.skill.rl_worker) with
        this context's config; returns its result.json (its tensors stay in out_dir)."""
        import json
        import subprocess
        import sys

        from tic.core.fsio import atomic_write_text

        job = out_dir / "job.json"
        atomic_write_text(job, json.dumps({"config": self.cfg.model_dump(mode="json"),
                                           "base_dir": str(Path(self.cfg.base_dir).resolve()),
                                           "checkpoint": str(checkpoint.resolve()), "out": str(out_dir.resolve())}))
        r = subprocess.run([sys.executable, "-m", "tic.skill.rl_worker", str(job)], capture_output=True, text=True,
                           timeout=timeout_s)
        if r.returncode == 2:
            raise TicInputError(r.stderr.strip().splitlines()[-1].removeprefix("tic: error: "))
        if r.returncode != 0 or not (out_dir / "result.json").is_file():
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"restore process exited {r.returncode}: {tail}")
        return json.loads((out_dir / "result.json").read_text())

    def scale_stage(self, stage, index: int) -> "GateContext":
        """A context for one scale-up stage: another model directory and/or config.json changes (generated
        weights), longer prompts, more generated tokens; same state directory."""
        import json

        from tic.core.fsio import atomic_write_text
        from tic.harness.model.generate import has_weights, read_model_config

        cfg = self.cfg.model_copy(deep=True)
        cfg.base_dir = self.cfg.base_dir
        if cfg.model is None:
            raise TicInputError("scale_up needs a model")
        src = self.cfg.resolve(stage.model_path) if stage.model_path is not None else self.model_source_dir
        if stage.config:
            if has_weights(src) or cfg.model.generate is None:
                raise TicInputError(f"scale_up stage {index}: config changes need generated weights (model.generate "
                                    "and no *.safetensors); point model_path at the larger model instead")
            d = (self.artifacts("C9") / f"stage-{index}").resolve()
            atomic_write_text(d / "config.json", json.dumps({**read_model_config(src), **stage.config}, indent=2))
            src = d
        cfg.model.path = Path(src).resolve()
        if stage.prompt_len is not None:
            cfg.prompts.min_len = min(cfg.prompts.min_len, stage.prompt_len)
            cfg.prompts.max_len = stage.prompt_len
        if stage.max_tokens is not None:
            cfg.sampling.max_tokens = stage.max_tokens
        sub = GateContext(cfg)
        sub.state = self.state
        return sub

    def require_live(self, side: str, gate: str) -> None:
        if getattr(self.cfg, side).engine == "dump":
            raise TicInputError(f"{gate} needs a live {side} engine (hf{' or vllm' if side == 'rollout' else ''}), "
                                "not a dump")

    def live_rollout_engine(self, gate: str) -> Engine:
        eng = self.rollout_engine()
        if eng.dumped_samples() is not None:
            raise TicInputError(f"{gate} needs a live rollout engine (hf or vllm), not a dump")
        return eng

    def dump_paths(self) -> tuple[Path, Path] | None:
        """(rollout dump, train dump) when both sides replay dumps, else None."""
        r, t = self.cfg.rollout, self.cfg.train
        if r.engine == "dump" and t.engine == "dump":
            return self.cfg.resolve(r.dump), self.cfg.resolve(t.dump)
        return None

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
