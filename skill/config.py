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


class ParallelLayout(Strict):
    """How one side spreads over ranks (GPUs, or gloo processes for the hf engine on CPU).

    The method covers layouts whose compared path has no cross-rank reduction: data parallel (requests split
    across replicas), expert parallel (tokens moved to their experts' ranks and back, merged on the owning
    rank) and training context parallel (sequence split, KV concatenated). Tensor parallel and decode
    context parallel sum partial results across ranks; C0 refuses them."""

    tp: int = Field(1, ge=1, description="tensor parallel: linear layers all-reduce partial sums across ranks")
    dp: int = Field(1, ge=1, description="data parallel: requests split across replicas")
    ep: int = Field(1, ge=1, description="expert parallel: experts split across ranks (vLLM: EP = DP x TP)")
    cp: int = Field(1, ge=1, description="context parallel (training): sequence split, KV all-gathered")
    dcp: int = Field(1, ge=1, description="decode context parallel (vLLM): attention partials merged across ranks")

    @property
    def world(self) -> int:
        """Ranks one replica set spans: every rank holds a DP x CP x TP coordinate."""
        return self.dp * self.cp * self.tp

    @model_validator(mode="after")
    def _check(self) -> "ParallelLayout":
        if self.world % self.ep:
            raise ValueError(f"ep={self.ep} must divide the ranks dp*cp*tp={self.world}")
        if self.tp % self.dcp:
            raise ValueError(f"dcp={self.dcp} must divide tp={self.tp} (decode context parallel splits TP ranks)")
        return self

    def describe(self) -> str:
        return " ".join(f"{k.upper()}{v}" for k, v in self.model_dump().items() if v != 1) or "1 rank"


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
    parallel: ParallelLayout = Field(default_factory=ParallelLayout, description="this side's rank layout")
    device: Literal["cpu", "cuda"] = Field("cpu", description="hf engine: where the model runs")
    dump: Path | None = Field(None, description="dump engine: JSONL file")
    options: dict[str, Any] = Field(default_factory=dict, description="engine-specific options (vllm)")
    patches: list[str] = Field(default_factory=list, description="bundled patches to apply (tic patch list)")

    @model_validator(mode="before")
    @classmethod
    def _tensor_parallel_size_alias(cls, data: Any) -> Any:
        """`tensor_parallel_size: N` (the vLLM spelling) is read as `parallel: {tp: N}`."""
        if isinstance(data, dict) and "tensor_parallel_size" in data:
            data = dict(data)
            tp = data.pop("tensor_parallel_size")
            par = dict(data.get("parallel") or {})
            if "tp" in par and par["tp"] != tp:
                raise ValueError(f"tensor_parallel_size={tp} contradicts parallel.tp={par['tp']}")
            par["tp"] = tp
            data["parallel"] = par
        return data

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.tp

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
    """RL loop facts that C0 checks against the method's coverage."""

    updates_per_step: int = Field(1, ge=1)
    speculative_decoding: bool = False


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
    state_dir: Path = Path(".tic")

    # set by load_config, not by the user
    base_dir: Path = Field(Path("."), exclude=True)

    def resolve(self, p: Path | None) -> Path | None:
        if p is None:
            return None
        p = Path(p).expanduser()
        return p if p.is_absolute() else (self.base_dir / p)

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


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(x) for x in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: {where}: {msg}{more}"


def parse_config(data: Any, base_dir: Path, source: str = "tic.yaml") -> TicConfig:
    if not isinstance(data, dict):
        raise TicInputError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        cfg = TicConfig.model_validate(data)
    except ValidationError as err:
        raise TicInputError(_format_validation_error(err, source)) from None
    cfg.base_dir = base_dir
    return cfg


def load_config(path: str | Path) -> TicConfig:
    path = Path(path)
    if not path.is_file():
        raise TicInputError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TicInputError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_config(data, path.resolve().parent, str(path))
