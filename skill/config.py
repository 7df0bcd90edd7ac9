"""tic.yaml: one pydantic model, strict (unknown keys and wrong types are rejected with their path)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tic.core.errors import TicInputError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)


class GenerateSpec(Strict):
    """Weights generated from config.json with a seed (no download), cached on first use."""

    seed: int = 0
    init_std: float | None = Field(None, gt=0, description="override config.initializer_range")


class ModelConfig(Strict):
    path: Path = Field(description="HF model directory (config.json + safetensors), relative to tic.yaml")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    generate: GenerateSpec | None = None


class EngineConfig(Strict):
    engine: Literal["hf", "vllm", "dump"] = "hf"
    # hf: "stock" is plain transformers; "consistent" runs tic's row-invariant CPU kernels and "vllm" the
    # installed vLLM's GPU kernels, both through tic's autograd wrappers (forward = kernel, backward = reference).
    kernels: Literal["stock", "consistent", "vllm"] = "stock"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    batch_size: int = Field(8, ge=1, description="requests per rollout batch / sequences per scoring batch")
    micro_batch_size: int = Field(4, ge=1, description="train: sequences per forward")
    padding_side: Literal["left", "right"] = "right"
    packing: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    device: Literal["cpu", "cuda"] = Field("cpu", description="hf engine: where the model runs")
    dump: Path | None = Field(None, description="dump engine: JSONL file")
    options: dict[str, Any] = Field(default_factory=dict, description="engine-specific options (vllm)")
    patches: list[str] = Field(default_factory=list, description="bundled patches to apply (tic patch list)")

    @model_validator(mode="after")
    def _dump_needs_file(self) -> "EngineConfig":
        if self.engine == "dump" and self.dump is None:
            raise ValueError("engine 'dump' needs 'dump: FILE.jsonl'")
        if self.patches:
            from tic import patches

            known = patches.registry()
            unknown = [n for n in self.patches if n not in known]
            if unknown:
                raise ValueError(f"unknown patch {unknown[0]!r}; bundled patches: {', '.join(sorted(known))}")
            targets = {known[n].target for n in self.patches}
            if self.engine not in targets:
                raise ValueError(f"patches target {', '.join(sorted(targets))}, not engine {self.engine!r}")
        return self


class PromptsConfig(Strict):
    source: Literal["random", "file"] = "random"
    count: int = Field(8, ge=1)
    seed: int = 0
    min_len: int = Field(4, ge=1)
    max_len: int = Field(16, ge=1)
    file: Path | None = Field(None, description="JSONL, one list of token ids per line (or {prompt_ids: [...]})")

    @model_validator(mode="after")
    def _check(self) -> "PromptsConfig":
        if self.min_len > self.max_len:
            raise ValueError(f"min_len {self.min_len} > max_len {self.max_len}")
        if self.source == "file" and self.file is None:
            raise ValueError("source 'file' needs 'file: PROMPTS.jsonl'")
        return self


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(16, ge=1)
    seed: int = 0


class TrainLayout(Strict):
    """C6: one training layout, as changes to the train engine's configured one."""

    micro_batch_size: int | None = Field(None, ge=1)
    padding_side: Literal["left", "right"] | None = None
    packing: bool | None = None

    def changes(self) -> dict:
        return self.model_dump(exclude_none=True)


class LayoutsConfig(Strict):
    """C3: where a probe request is placed when it is compared with itself alone.
    C6: which training layouts must reproduce the configured one bit for bit."""

    batch_sizes: list[int] = Field(default_factory=lambda: [2, 5, 8])
    positions: list[Literal["first", "middle", "last"]] = Field(default_factory=lambda: ["first", "last"])
    probes: int = Field(2, ge=1, description="how many requests are checked alone vs in batch")
    train: list[TrainLayout] = Field(default_factory=lambda: [
        TrainLayout(micro_batch_size=1), TrainLayout(padding_side="left"), TrainLayout(packing=True)])


class TrainingConfig(Strict):
    """RL loop facts that C0 checks against the method's coverage, and the small RL run of C8/C9."""

    updates_per_step: int = Field(1, ge=1, description="optimizer updates per RL step (the method needs 1)")
    speculative_decoding: bool = False
    updates: int = Field(2, ge=1, description="C8: consecutive RL updates, each followed by weight sync")
    lr: float = Field(1e-3, gt=0, description="C8/C9: AdamW learning rate of the policy-gradient step")


class PerfConfig(Strict):
    """C1/C10: the rollout workload measured for throughput, and what makes the baseline."""

    requests: int = Field(16, ge=1, description="requests per measured pass")
    input_len: int = Field(32, ge=1, description="prompt tokens per request")
    output_len: int = Field(32, ge=1, description="generated tokens per request")
    concurrency: int = Field(8, ge=1, description="requests submitted together (one engine batch)")
    seed: int = 0
    warmup: int = Field(1, ge=0, description="unmeasured passes per side before timing")
    repeats: int = Field(3, ge=1, description="C10: measured passes per side, alternating baseline/consistent")
    floor: float = Field(0.70, gt=0, description="C10: least consistent/baseline throughput ratio (median)")
    baseline: dict[str, Any] | None = Field(
        None, description="rollout.* changes that make the baseline (default: the engine's consistency "
                          "switch turned off, e.g. kernels: stock for hf)")
    baseline_env: dict[str, str] = Field(default_factory=dict, description="env vars set while the baseline runs")
    consistent_env: dict[str, str] = Field(default_factory=dict,
                                           description="env vars set while the consistent rollout runs")
    baseline_dir: Path | None = Field(None, description="frozen baseline files (default STATE_DIR/baseline)")


class ScaleStage(Strict):
    """C9: one stage of the stepwise scale-up; C5 is re-run on it."""

    name: str | None = None
    model_path: Path | None = Field(None, description="another model directory (e.g. the full model)")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="config.json changes for generated weights, e.g. num_hidden_layers")
    prompt_len: int | None = Field(None, ge=1, description="longest prompt (prompts.max_len) at this stage")
    max_tokens: int | None = Field(None, ge=1, description="generated tokens per request at this stage")


class GradientsConfig(Strict):
    """C7: how close the training path's gradients must be to the float32 reference, per parameter tensor.
    Unset: by the model's dtype, float32 cosine >= 0.999 and relative error <= 1e-2; bf16/fp16 cosine >= 0.99
    and relative error <= 0.1."""

    min_cosine: float | None = Field(None, gt=0, le=1)
    max_rel_error: float | None = Field(None, gt=0)
    advantage_seed: int = 0


class LocateConfig(Strict):
    enabled: bool = True


class CutConfig(Strict):
    """C2 / `tic cut`: where the small model goes and which layers it keeps."""

    out: Path | None = Field(None, description="cut directory, relative to tic.yaml (default .tic/artifacts/C2/cut)")
    layers: str | list[int] = Field("auto", description="'auto' or layer indices, e.g. [3, 4, 17]")
    max_layers: int = Field(6, ge=1, description="auto: at most this many layers")


class TicConfig(Strict):
    model: ModelConfig | None = Field(None, description="needed by every gate except dump-only C5")
    rollout: EngineConfig = Field(default_factory=EngineConfig)
    train: EngineConfig = Field(default_factory=EngineConfig)
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    layouts: LayoutsConfig = Field(default_factory=LayoutsConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    locate: LocateConfig = Field(default_factory=LocateConfig)
    gradients: GradientsConfig = Field(default_factory=GradientsConfig)
    cut: CutConfig | None = None
    perf: PerfConfig = Field(default_factory=PerfConfig)
    scale_up: list[ScaleStage] = Field(default_factory=list, description="C9: stages re-running C5")
    state_dir: Path = Field(Path(".tic"), description="results and artifacts, relative to tic.yaml's folder")

    # set by load_config, not by the user
    base_dir: Path = Field(Path("."), exclude=True)

    def resolve(self, p: Path | None) -> Path | None:
        if p is None:
            return None
        p = Path(p).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)

    @property
    def state_path(self) -> Path:
        """Where results and artifacts live: state_dir relative to tic.yaml's folder (like .git beside a repo)."""
        return self.resolve(self.state_dir)

    def config_hash(self) -> str:
        """Hash of what changes the numbers (paths resolved, state_dir left out)."""
        data = self.model_dump(mode="json", exclude={"state_dir", "base_dir"})
        if self.model is not None:
            data["model"]["path"] = str(self.resolve(self.model.path))
        for side in ("rollout", "train"):
            if data[side]["dump"]:
                data[side]["dump"] = str(self.resolve(Path(data[side]["dump"])))
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the config section at `loc` (the unknown key's parent) accepts."""
    model: Any = TicConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        model = next((a for a in (*getattr(ann, "__args__", ()), ann) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return [k for k, f in model.model_fields.items() if not f.exclude]


def _format_validation_error(err: ValidationError, source: str) -> str:
    """Every error on one line, each with its path; unknown keys with the keys allowed there."""
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(tuple(e["loc"]))
            msg = "unknown key" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif e["type"] in ("literal_error", "enum"):
            msg = f"got {e['input']!r}, {msg[0].lower()}{msg[1:]}"
        parts.append(f"{where}: {msg}")
    n = len(parts)
    return f"{source}: " + (parts[0] if n == 1 else f"{n} errors: " + "; ".join(parts))


def parse_config(data: Any, base_dir: Path, source: str = "tic.yaml") -> TicConfig:
    if not isinstance(data, dict):
        raise TicInputError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = TicConfig.model_validate(data)
    except ValidationError as err:
        raise TicInputError(_format_validation_error(err, source)) from None
    cfg.base_dir = base_dir
    return cfg


CONFIG_NAME = "tic.yaml"


def find_config(cwd: Path | None = None) -> Path:
    """tic.yaml in the working directory, or one line saying there is none and what to pass instead."""
    cwd = Path(cwd or Path.cwd())
    path = cwd / CONFIG_NAME
    if path.is_file():
        return path
    near = sorted(p.name for p in cwd.glob("tic*.yaml"))
    hint = f" (here: {', '.join(near)})" if near else ""
    raise TicInputError(f"no {CONFIG_NAME} in {cwd}: pass -c PATH/TO/tic.yaml{hint}, or copy an example of the "
                        "skill (examples/tiny-qwen3) and run tic there")


def load_config(path: str | Path | None = None) -> TicConfig:
    path = find_config() if path is None else Path(path)
    if not path.is_file():
        raise TicInputError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TicInputError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_config(data, path.resolve().parent, str(path))
