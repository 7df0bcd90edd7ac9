"""tic.yaml: one pydantic model, strict (unknown keys and wrong types are rejected with their path)."""

from __future__ import annotations

import hashlib
import json
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from tic.core.errors import TicInputError
from tic.core.strict_yaml import load_yaml_file

# Upper bounds keep a typo (an extra digit or ten) from becoming an hours-long run or an out-of-memory crash.
MAX_COUNT = 1_000_000
MAX_SEED = 2**63 - 1


class Strict(BaseModel):
    # Parsed configs are validated in strict JSON mode (parse_config): true/false is never a number, "8" never
    # an int; NaN/Inf never a setting.
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True, allow_inf_nan=False)


class GenerateSpec(Strict):
    """Weights generated from config.json with a seed (no download), cached on first use."""

    seed: int = Field(0, ge=0, le=MAX_SEED)
    init_std: float | None = Field(None, gt=0, description="override config.initializer_range")
    quantization: Literal["fp8"] | None = Field(None, description="fp8: write the generated weights as a block-FP8 "
                                                "checkpoint, as Qwen3-*-FP8 ship (tic.harness.model.quantize)")
    weight_block_size: list[int] = Field([128, 128], description="quantization fp8: the weight tile [n, k] one "
                                         "scale covers (square: activations are quantized in groups of k)")

    @field_validator("weight_block_size")
    @classmethod
    def _square_block(cls, v: list[int]) -> list[int]:
        if len(v) != 2 or v[0] != v[1] or v[0] <= 0:
            raise ValueError(f"weight_block_size must be two equal positive integers, got {v}")
        return v


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

    tp: int = Field(1, ge=1, le=MAX_COUNT, description="tensor parallel: linear layers all-reduce partial sums across ranks")
    dp: int = Field(1, ge=1, le=MAX_COUNT, description="data parallel: requests split across replicas")
    ep: int = Field(1, ge=1, le=MAX_COUNT, description="expert parallel: experts split across ranks (vLLM: EP = DP x TP)")
    cp: int = Field(1, ge=1, le=MAX_COUNT, description="context parallel (training): sequence split, KV all-gathered")
    dcp: int = Field(1, ge=1, le=MAX_COUNT, description="decode context parallel (vLLM): attention partials merged across ranks")

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


class BackwardConfig(Strict):
    """train, hf engine with kernels consistent or vllm: how the surrogate backward of tic's kernel wrappers runs.
    Speed switches: either way each operator's gradient is the same closed form, within rounding (C7 judges it
    against its float32 reference); off is the plain path, for a benchmark or a torch whose compiler or grouped
    GEMM misbehaves here (a failure already falls back to it, and the train step benchmark reports why)."""

    model_config = ConfigDict(**Strict.model_config, frozen=True)  # part of the model cache key

    fuse: bool = Field(True, description="on CUDA, compile each written-out backward with torch.compile into a few "
                                         "fused kernels (eager: one kernel per elementwise op); false: eager")
    grouped_mm: bool = Field(True, description="MoE: the experts' backward GEMMs as one torch._grouped_mm launch each "
                                               "(bf16 models); false: one GEMM per expert")


# what a rollout dump may say of the vLLM that wrote it, for a training side on vLLM's kernels to match: its KV page
# size and its model runner (v1: float32 log_softmax logprobs; v2, vLLM 0.26's pick for dense models: its own kernel)
DUMP_OPTIONS = ("kv_block_size", "model_runner")


def _check_dump_options(options: dict) -> None:
    unknown = [k for k in options if k not in DUMP_OPTIONS]
    if unknown:
        raise ValueError(f"dump engine: unknown option {unknown[0]!r} (a dump takes {', '.join(DUMP_OPTIONS)}: "
                         "what the vLLM that wrote it ran)")
    block = options.get("kv_block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"dump engine: kv_block_size {block!r} (a positive integer: vLLM's KV page size)")
    if options.get("model_runner") not in (None, "v1", "v2"):
        raise ValueError(f"dump engine: model_runner {options['model_runner']!r} (v1 or v2)")


class EngineConfig(Strict):
    engine: Literal["hf", "vllm", "dump", "megatron"] = "hf"
    # hf: "stock" is plain transformers; "consistent" runs tic's row-invariant CPU kernels and "vllm" the
    # installed vLLM's GPU kernels, both through tic's autograd wrappers (forward = kernel, backward = reference).
    kernels: Literal["stock", "consistent", "vllm"] = "stock"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    batch_size: int = Field(8, ge=1, le=MAX_COUNT, description="requests per rollout batch / sequences per scoring batch")
    micro_batch_size: int = Field(4, ge=1, le=MAX_COUNT, description="train: sequences per forward")
    padding_side: Literal["left", "right"] = "right"
    packing: bool = False
    order: Literal["given", "reversed", "shuffled"] = Field(
        "given", description="hf: the order in which sequences fill micro-batches when scoring and training "
                             "(shuffled: one fixed seeded permutation)")
    parallel: ParallelLayout = Field(default_factory=ParallelLayout, description="this side's rank layout")
    device: Literal["cpu", "cuda"] = Field("cpu", description="hf engine: where the model runs")
    dump: Path | None = Field(None, description="dump engine: JSONL file")
    options: dict[str, Any] = Field(default_factory=dict, description="engine-specific options (vllm)")
    patches: list[str] = Field(default_factory=list, description="bundled patches to apply (tic patch list)")
    backward: BackwardConfig = Field(default_factory=BackwardConfig,
                                     description="train: how the kernel wrappers' surrogate backward runs")

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
        if self.engine == "dump":
            _check_dump_options(self.options)
        if self.patches:
            from tic import patches

            known = patches.registry()
            unknown = [n for n in self.patches if n not in known]
            if unknown:
                raise ValueError(f"unknown patch {unknown[0]!r}; bundled patches: {', '.join(sorted(known))}")
            why = patches.conflict(list(self.patches))
            if why:
                raise ValueError(why)
            targets = {known[n].engine or known[n].target for n in self.patches}
            if self.engine not in targets:
                raise ValueError(f"patches target {', '.join(sorted(targets))}, not engine {self.engine!r}")
        return self


class PromptsConfig(Strict):
    source: Literal["random", "file"] = "random"
    count: int = Field(8, ge=1, le=MAX_COUNT)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    min_len: int = Field(4, ge=1, le=MAX_COUNT)
    max_len: int = Field(16, ge=1, le=MAX_COUNT)
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
    max_tokens: int = Field(16, ge=1, le=MAX_COUNT)
    seed: int = Field(0, ge=0, le=MAX_SEED)


class TrainLayout(Strict):
    """C6: one training layout, as changes to the train engine's configured one."""

    micro_batch_size: int | None = Field(None, ge=1, le=MAX_COUNT)
    padding_side: Literal["left", "right"] | None = None
    packing: bool | None = None
    order: Literal["given", "reversed", "shuffled"] | None = None

    def changes(self) -> dict:
        return self.model_dump(exclude_none=True)


class LayoutsConfig(Strict):
    """C3: where a probe request is placed when it is compared with itself alone.
    C6: which training layouts must reproduce the configured one bit for bit."""

    # a batch of 1 is the probe alone: comparing it with itself would pass whatever the kernels do
    batch_sizes: list[Annotated[int, Field(ge=2, le=MAX_COUNT)]] = Field(
        default_factory=lambda: [2, 5, 8], min_length=1, description="batch sizes, each at least 2")
    positions: list[Literal["first", "middle", "last"]] = Field(default_factory=lambda: ["first", "last"],
                                                                min_length=1)
    probes: int = Field(2, ge=1, le=MAX_COUNT, description="how many requests are checked alone vs in batch")
    train: list[TrainLayout] = Field(min_length=1, default_factory=lambda: [
        TrainLayout(micro_batch_size=1), TrainLayout(padding_side="left"), TrainLayout(packing=True),
        TrainLayout(order="shuffled")])


class TrainingConfig(Strict):
    """RL loop facts that C0 checks against the method's coverage, and the small RL run of C8/C9."""

    updates_per_step: int = Field(1, ge=1, le=MAX_COUNT, description="optimizer updates per RL step (the method needs 1)")
    speculative_decoding: bool = False
    updates: int = Field(2, ge=1, le=MAX_COUNT, description="C8: consecutive RL updates, each followed by weight sync")
    lr: float = Field(1e-3, gt=0, description="C8/C9: AdamW learning rate of the policy-gradient step")


class PerfConfig(Strict):
    """C1/C10: the rollout workload measured for throughput, and what makes the baseline."""

    requests: int = Field(16, ge=1, le=MAX_COUNT, description="requests per measured pass")
    input_len: int = Field(32, ge=1, le=MAX_COUNT, description="prompt tokens per request")
    output_len: int = Field(32, ge=1, le=MAX_COUNT, description="generated tokens per request")
    concurrency: int = Field(8, ge=1, le=MAX_COUNT, description="requests submitted together (one engine batch)")
    seed: int = 0
    warmup: int = Field(1, ge=0, le=MAX_COUNT, description="unmeasured passes per side before timing")
    repeats: int = Field(3, ge=1, le=MAX_COUNT, description="C10: measured passes per side, alternating baseline/consistent")
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
    prompt_len: int | None = Field(None, ge=1, le=MAX_COUNT, description="longest prompt (prompts.max_len) at this stage")
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT, description="generated tokens per request at this stage")


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
    layers: str | list[Annotated[int, Field(ge=0)]] = Field("auto", description="'auto' or layer indices, e.g. [3, 4, 17]")
    max_layers: int = Field(6, ge=1, le=MAX_COUNT, description="auto: at most this many layers")

    @field_validator("layers")
    @classmethod
    def _layers_spec(cls, v):
        if isinstance(v, str) and v.strip().lower() != "auto":
            items = [x.strip() for x in v.split(",")]
            if not all(x.isdigit() for x in items):
                raise ValueError(f"expected 'auto', a list of layer indices or '3,4,17', got {v!r}")
        if isinstance(v, list) and not v:
            raise ValueError("expected at least one layer index")
        return v


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
    _source_file: Path | None = PrivateAttr(None)  # the tic.yaml read, an input no output may replace

    @property
    def source_file(self) -> Path | None:
        return self._source_file

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


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Optional, unions, lists and dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _known_keys(loc: tuple) -> list[str]:
    """The keys tic.yaml allows at the mapping that holds loc's last key."""
    models: list[type[BaseModel]] = [TicConfig]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        models = [m for model in models if part in model.model_fields
                  for m in _models_in(model.model_fields[part].annotation)]
    return list(dict.fromkeys(k for m in models for k, f in m.model_fields.items() if not f.exclude))  # as declared


def _format_error(e: dict) -> str:
    where = ".".join(str(x) for x in e["loc"]) or "(top level)"
    if e["type"] == "extra_forbidden":
        known = _known_keys(tuple(e["loc"]))
        return f"{where}: unknown key" + (f" (allowed: {', '.join(known)})" if known else "")
    msg = e["msg"].removeprefix("Value error, ")
    got = e.get("input")
    if e["type"] != "missing" and not isinstance(got, (dict, list)):
        shown = json.dumps(got) if got is None or isinstance(got, (bool, int, float)) else repr(got)
        if shown not in msg:
            msg += f" (got {shown})"
    return f"{where}: {msg}"


def _format_validation_error(err: ValidationError, source: str) -> str:
    """Every problem on one line, each with its path, what is allowed, and what was given."""
    parts = [_format_error(e) for e in err.errors()]
    return f"{source}: " + (parts[0] if len(parts) == 1 else f"{len(parts)} errors: " + "; ".join(parts))


def parse_config(data: Any, base_dir: Path, source: str = "tic.yaml") -> TicConfig:
    """Validate parsed YAML (or a dict) strictly: the data goes through JSON, where pydantic's strict mode
    takes paths as strings but never takes true for 1 or "8" for 8."""
    if not isinstance(data, dict):
        raise TicInputError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if "base_dir" in data:
        raise TicInputError(f"{source}: base_dir: unknown key (allowed: {', '.join(_known_keys(('base_dir',)))})")
    try:
        blob = json.dumps(data, default=str, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TicInputError(f"{source}: a value is not plain data ({e})") from None
    try:
        cfg = TicConfig.model_validate_json(blob, strict=True)
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
    cfg = parse_config(load_yaml_file(path), path.resolve().parent, str(path))
    cfg._source_file = path.resolve()
    return cfg
