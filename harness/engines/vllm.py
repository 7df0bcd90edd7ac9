"""vLLM rollout engine (vLLM 0.26, V1 engine, in-process) for C3, C4, C5 and the locator.

- Prompts are token ids (TokensPrompt); the tokenizer is skipped (skip_tokenizer_init, detokenize=False).
- Rollout: SamplingParams(seed=per request, logprobs=0, ignore_eos=True); each sampled token's logprob is read
  exactly as vLLM reports it (logprobs_mode raw_logprobs by default: the raw logits' log_softmax in float32,
  computed by the V1 runner's sampler with torch, by the V2 runner's with a Triton kernel of its own; the engine
  says which, `rollout_kernels`, and a training side on vLLM's kernels follows it).
- Scoring (C4's prefill side): the whole sequence as one prompt with prompt_logprobs=0 and max_tokens=1.
- generate_together submits all requests in one call, sized so that vLLM's scheduler runs them in one batch.
- The locator (tic.harness.locate.vllm_capture) hooks the model inside this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0): `model()`, `model_runner()`, `abort_unfinished()`.

vLLM is imported only when an engine is built; the record conversions below need only torch, so the CPU
tests exercise them on records saved from a real device run.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tic.config.schema import EngineConfig
from tic.core.env import env_overlay
from tic.harness.engines.base import Engine, Sample, Sampling, request_seed
from tic.harness.kernels.spec import DEFAULT_KV_BLOCK_SIZE, RolloutKernels
from tic.harness.model.facts import ModelFacts
from tic.core.errors import TicInputError

# rollout.options understood by this engine, with their defaults.
OPTIONS: dict[str, Any] = {
    "enforce_eager": True,            # no torch.compile, no CUDA graphs (hooks for capture need eager)
    "attention_backend": None,        # e.g. FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER (None: vLLM picks)
    "batch_invariant": None,          # True/False sets VLLM_BATCH_INVARIANT before vLLM is imported; None: env
    "gpu_memory_utilization": 0.3,
    "kv_cache_memory_bytes": None,    # set to skip vLLM's memory profiling (several engines on one GPU)
    "max_model_len": None,            # None: min(max_position_embeddings, 2048)
    "kv_cache_dtype": None,           # e.g. fp8: LLM(kv_cache_dtype=...); a train side on vLLM's kernels sets its
                                      # hf option kv_cache_dtype alike (K/V make the same FP8 round trip)
    "mamba_ssm_cache_dtype": None,    # e.g. float32: LLM(mamba_ssm_cache_dtype=...), the Mamba-2 state between
                                      # chunks (a train side on vLLM's kernels runs it in float32)
    "seed": 0,                        # LLM(seed=...): vLLM's global seed; requests carry their own seeds
    "compilation_config": None,       # passed to LLM(compilation_config=...) (int level or dict)
    "cudagraph_mode": None,           # shorthand for compilation_config.cudagraph_mode (NONE, PIECEWISE, FULL, ...)
    "ir_op_priority": None,           # LLM(ir_op_priority=...): vLLM IR op implementations by priority, e.g.
                                      # {rms_norm: [vllm_c], fused_add_rms_norm: [vllm_c]} (the CUDA kernels)
    "enable_chunked_prefill": None,
    "max_num_batched_tokens": None,   # chunked prefill: the prefill chunk size per step
    "max_num_seqs": None,
    "enable_prefix_caching": False,   # off: a repeated prompt is recomputed, not read from the cache
    "async_scheduling": None,
    "logprobs_mode": "raw_logprobs",
    "model_runner": None,             # v1 or v2 sets VLLM_USE_V2_MODEL_RUNNER (capture needs v1); None: vLLM picks
    "record": None,                   # JSONL file: every raw vLLM output this engine converts (device fixtures)
    # inline: vLLM's engine core in this process (module hooks for capture/locate, weight sync through the
    # model); own: in a process of its own, started with this engine's TIC_PATCHES and VLLM_BATCH_INVARIANT,
    # so sides with different consistency switches run in one measurement (C1/C10 use it)
    "engine_process": "inline",
}

_LLMS: dict[str, Any] = {}  # one vLLM engine per process and configuration (they hold the GPU)
_START_ENV: dict[str, dict[str, str]] = {}  # engine cores of their own: the switch variables they started with
_V2_RUNNER: dict[str, bool] = {}  # whether vLLM picked its V2 model runner for the engine


def check_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TicInputError(f"rollout.options: unknown vllm option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
    out = {**OPTIONS, **options}
    if out["logprobs_mode"] not in ("raw_logprobs", "processed_logprobs"):
        raise TicInputError(f"rollout.options.logprobs_mode: {out['logprobs_mode']!r} is not a logprob mode "
                            "(raw_logprobs or processed_logprobs)")
    if out["batch_invariant"] not in (None, True, False):
        raise TicInputError("rollout.options.batch_invariant: expected true, false or null")
    if out["engine_process"] not in ("inline", "own"):
        raise TicInputError(f"rollout.options.engine_process: {out['engine_process']!r} (expected inline or own)")
    return out


# -- which of vLLM's modes tic's consistent path covers (C0; no vLLM needed) --------------------------------
# the IR ops the training side's vLLM provider calls as their vllm_c implementations
_PROVIDER_IR_OPS = ("rms_norm", "fused_add_rms_norm")
# options that choose vLLM's execution mode; the consistent rollout may set them, its baseline runs vLLM's defaults
MODE_OPTIONS = ("enforce_eager", "compilation_config", "cudagraph_mode", "ir_op_priority")
REPLACES_BATCH_INVARIANT = ("fa3-fixed-tile", "rmsnorm-rows", "gemm-fixed-order")


def _priority_list(value) -> list[str]:
    """An IR op priority as vLLM reads it: a list of implementation names, or one comma-separated string."""
    if isinstance(value, str):
        return [v for v in value.replace(" ", "").split(",") if v]
    return [str(v) for v in value or []]


def compiles_with_inductor(options: dict) -> bool:
    """Whether vLLM compiles the model with Inductor under these options: not enforce_eager and a compilation
    mode above NONE (vLLM's default when none is given is VLLM_COMPILE) on the inductor backend."""
    o = {**OPTIONS, **options}
    comp = _compilation(o)
    return not o["enforce_eager"] and _compiles(comp) and str(comp.get("backend") or "inductor") == "inductor"


def _compilation(o: dict) -> dict:
    """compilation_config as a dict (an int or a name is its mode)."""
    comp = o["compilation_config"]
    return {"mode": comp} if isinstance(comp, (int, str)) else dict(comp or {})


def _compiles(comp: dict) -> bool:
    """A compilation mode above NONE (vLLM's default when none is given is VLLM_COMPILE)."""
    return str(comp.get("mode", comp.get("level", 3))).upper() not in ("0", "NONE")


def mode_refusals(options: dict, train_kernels: str) -> list[str]:
    """Why these rollout options are outside what tic makes consistent (one line each, for C0)."""
    o = {**OPTIONS, **options}
    out = []
    bi = o["batch_invariant"] if o["batch_invariant"] is not None else os.environ.get("VLLM_BATCH_INVARIANT") == "1"
    if bi:
        out.append("rollout.options.batch_invariant: vLLM's batch-invariant mode is not covered (its Triton norm "
                   "and GEMMs on the rollout against the training forward did not reach diff = 0 on real layer "
                   f"shapes); tic's patches replace it: batch_invariant: false with rollout.patches: "
                   f"[{', '.join(REPLACES_BATCH_INVARIANT)}]")
    if train_kernels == "vllm" and compiles_with_inductor(o):
        comp = o["compilation_config"] if isinstance(o["compilation_config"], dict) else {}
        custom = [str(c) for c in comp.get("custom_ops") or []]
        prio = o["ir_op_priority"] if isinstance(o["ir_op_priority"], dict) else {}
        pinned = all(_priority_list(prio.get(op))[:1] == ["vllm_c"] for op in _PROVIDER_IR_OPS)
        if "all" not in custom or any(c.startswith("-") for c in custom) or not pinned:
            out.append("rollout.options.compilation_config: under Inductor (compiled mode, vLLM's default) vLLM "
                       "replaces its CUDA norm, SiLU*mul and rotary kernels, which the training forward (kernels: "
                       "vllm) calls, by generated code; keep them with compilation_config.custom_ops: [all] and "
                       "ir_op_priority: {rms_norm: [vllm_c], fused_add_rms_norm: [vllm_c]}, or set mode: 0")
    return out


def recurrent_refusals(model_config: dict, options: dict, patch_names) -> list[str]:
    """Why a vLLM rollout of this model is outside what tic makes consistent: Mamba mixers with prefix caching,
    Mamba-1 mixers without the mamba1-prefill-steps patch or without a float32 state cache, Mamba-2 mixers without
    the mamba-decode-replay patch, or either in a mode not measured (eager and decode-only full CUDA graphs are;
    one line, for C0)."""
    from tic.harness.kernels.mamba_modules import is_mixer, is_mixer1
    from tic.harness.model.layer_structure import build_meta

    modules = list(build_meta(model_config).modules())
    selective = sum(1 for m in modules if is_mixer1(m))
    mixers = sum(1 for m in modules if is_mixer(m))
    o = {**OPTIONS, **options}
    if (selective or mixers) and o["enable_prefix_caching"]:
        return ["rollout.options.enable_prefix_caching: prefix caching of Mamba states (vLLM's mamba_cache_mode "
                "align or all) moves a sequence's state between cache blocks, which tic's Mamba patches do not "
                "follow; set enable_prefix_caching: false"]
    if selective and "mamba1-prefill-steps" not in patch_names:
        return [f"rollout.engine: vllm on a model with {selective} Mamba-1 (selective scan) mixer(s): vLLM 0.26 "
                "prefills them with selective_scan_fn and decodes them with selective_state_update, two rounding "
                "orders; list the patch mamba1-prefill-steps in rollout.patches, or roll out with engine: hf, "
                "kernels: consistent (guides/ops/recurrent-layers.md)"]
    if selective and str(o["mamba_ssm_cache_dtype"]) != "float32":
        return ["rollout.options.mamba_ssm_cache_dtype: mamba1-prefill-steps stores the Mamba-1 state between "
                "tokens in the cache's dtype and the training forward keeps it in float32; set "
                "mamba_ssm_cache_dtype: float32"]
    if mixers and "mamba-decode-replay" not in patch_names:
        return [f"rollout.engine: vllm on a model with {mixers} Mamba-2 mixer(s): vLLM 0.26 decodes a mixer by the "
                "single-step state update (selective_state_update), which rounds differently from the chunked "
                "scan that prefilled the sequence and that the training forward runs; list the patch "
                "mamba-decode-replay in rollout.patches, or roll out with engine: hf, kernels: consistent "
                "(guides/ops/recurrent-layers.md)"]
    if (selective or mixers) and not (o["enforce_eager"] or decode_graphs_only(options)):
        what = ("mamba-decode-replay has been measured" if mixers else
                "mamba1-prefill-steps is held to the modes mamba-decode-replay was measured in:")
        return [f"rollout.patches: {what} eager and with full CUDA graphs of the decode steps without torch.compile; "
                "set rollout.options.enforce_eager: true, or enforce_eager: false with compilation_config: "
                "{mode: 0} and cudagraph_mode: FULL_DECODE_ONLY"]
    return []


def decode_graphs_only(options: dict) -> bool:
    """Whether vLLM runs eager kernels with full CUDA graphs of the decode steps alone: CUDA graphs on, no
    compilation, cudagraph_mode FULL_DECODE_ONLY (the shorthand or compilation_config's)."""
    o = {**OPTIONS, **options}
    comp = _compilation(o)
    graphs = o["cudagraph_mode"] if o["cudagraph_mode"] is not None else comp.get("cudagraph_mode")
    return not o["enforce_eager"] and not _compiles(comp) and str(graphs).upper() == "FULL_DECODE_ONLY"


def context_length(options: dict, max_positions: int) -> int:
    """The rollout's max_model_len: rollout.options.max_model_len, else the model's positions up to 2048."""
    return int(options.get("max_model_len") or min(int(max_positions), 2048))


def backend_refusals(model_config: dict, options: dict, train_kernels: str) -> list[str]:
    """A training forward on vLLM's kernels mirrors vLLM's native model code (its rotary, norms, MLPs). vLLM runs an
    architecture its registry does not implement (or any, with model_impl: transformers) through its Transformers
    backend, HF's modeling code with vLLM's attention and linears, whose rotary and norms are HF's torch code: the
    two sides would run different operators. Read from the installed vLLM's registry; none where vLLM is absent
    (C0 refuses a vLLM rollout on such a machine for that reason already)."""
    if train_kernels != "vllm":
        return []
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except ImportError:
        return []
    archs = list(model_config.get("architectures") or [])
    native = [a for a in archs if a in _VLLM_MODELS and _VLLM_MODELS[a][0] != "transformers"]
    if native and str(options.get("model_impl", "auto")) != "transformers":
        return []
    return [f"rollout.engine: vllm runs {', '.join(archs) or 'this model'} through its Transformers backend (HF's "
            "modeling code, HF's rotary and norms in torch), which train.kernels: vllm does not mirror; use an "
            "architecture vLLM implements natively, or kernels: consistent on both sides (guides/vllm.md)"]


def _partial_rotary_factor(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


@dataclass(frozen=True)
class ConfigDeparture:
    """A config field that vLLM's model code for an architecture overrides or never reads: vLLM then computes
    another model than the checkpoint's, which both sides of C3/C4 would agree on and only C5 (against the
    training forward) or C2 would show, late and unexplained."""
    architecture: str
    field: str
    read: Callable[[dict], object]          # the field's value in the (text) config
    vllm_reads: Callable[[object], bool]    # whether vLLM computes the model this value describes
    vllm_runs: str                          # what vLLM's model code computes instead
    versions: str = ">=0.26.0,<0.27"        # the vLLM releases whose model code this was read from


CONFIG_DEPARTURES = (
    ConfigDeparture("GlmForCausalLM", "partial_rotary_factor", _partial_rotary_factor, lambda v: v == 0.5,
                    "a rotary over half of each head (GlmForCausalLM sets the factor to 0.5 before building its "
                    "layers)"),
    ConfigDeparture("StableLmForCausalLM", "use_parallel_residual", lambda c: bool(c.get("use_parallel_residual")),
                    lambda v: not v, "attention and the MLP in sequence (its decoder layer does not read the field)"),
)


def departure_refusals(model_config: dict, vllm_version: str | None) -> list[str]:
    """One line per CONFIG_DEPARTURES entry this model meets on vLLM `vllm_version` (every entry when it is None:
    C0 refuses a vLLM rollout on a machine without vLLM for that reason already)."""
    from packaging.specifiers import SpecifierSet

    from tic.harness.model.layer_structure import text_config

    cfg = text_config(model_config)
    archs = set(model_config.get("architectures") or [])
    out = []
    for d in CONFIG_DEPARTURES:
        if d.architecture not in archs or (vllm_version and vllm_version not in SpecifierSet(d.versions)):
            continue
        value = d.read(cfg)
        if not d.vllm_reads(value):
            out.append(f"rollout.engine: vllm runs {d.architecture} with {d.vllm_runs}, not the config's "
                       f"{d.field}={value}: it would compute another model than the checkpoint's; roll out with "
                       "engine: hf, or use a config vLLM reads as written (guides/vllm.md)")
    return out


WINDOW_PATCH = "fa3-fixed-tile"  # launches each windowed row as decode does (patches/vllm/fa3_fixed_tile.py)


def window_refusals(model_config: dict, options: dict, patches=()) -> list[str]:
    """Why a vLLM rollout of this model is outside what tic makes consistent: attention layers with a sliding
    window shorter than the rollout's context, without the patch that launches each windowed row as decode does
    (one line, for C0). Measured on an H100 (vLLM 0.26, FA3): a windowed row's bits follow which query rows share
    its tile, so decode and prefill disagree once the window's left edge passes key 0."""
    from tic.harness.model.families import layer_kinds
    from tic.harness.model.layer_structure import text_config

    cfg = text_config(model_config)
    window = cfg.get("sliding_window")
    sliding = [i for i, k in enumerate(layer_kinds(cfg)) if k["attention"] == "sliding"]
    if not sliding or not isinstance(window, int) or window <= 0 or WINDOW_PATCH in (patches or ()):
        return []
    context = context_length(options, cfg.get("max_position_embeddings") or 2048)
    if context <= window:
        return []  # no row ever sees a key outside its window: the layer computes full causal attention
    return [f"rollout.engine: vllm on a model with sliding-window attention ({len(sliding)} layer(s), window "
            f"{window} < max_model_len {context}) without the {WINDOW_PATCH} patch: FA3's windowed decode and "
            f"prefill give a row different bits (C4 fails in the sliding layers' attention); add {WINDOW_PATCH} to "
            "rollout.patches, or roll out with engine: hf, kernels: consistent (guides/ops/attention-prefill-decode.md)"]


# -- conversions between vLLM outputs, plain records and Samples (no vLLM needed) ---------------------------
def _lp_dict(d) -> dict[str, float]:
    """One position of vLLM logprobs ({token_id: Logprob}) as {str(token_id): float}."""
    if d is None:
        return None
    return {str(int(k)): float(v.logprob if hasattr(v, "logprob") else v) for k, v in d.items()}


def output_record(out, kind: str, request_id: int | None) -> dict:
    """A vLLM RequestOutput as a plain JSON record: ids and every logprob entry exactly as reported."""
    comp = out.outputs[0]
    return {
        "kind": kind,
        "request_id": request_id,
        "prompt_token_ids": [int(t) for t in out.prompt_token_ids],
        "token_ids": [int(t) for t in comp.token_ids],
        "logprobs": None if comp.logprobs is None else [_lp_dict(d) for d in comp.logprobs],
        "prompt_logprobs": None if out.prompt_logprobs is None else [_lp_dict(d) for d in out.prompt_logprobs],
    }


def _exact_f32(values: list[float], what: str) -> torch.Tensor:
    """Python floats that vLLM produced from float32 tensors -> float32 tensor, refusing any rounding."""
    t64 = torch.tensor(values, dtype=torch.float64)
    t32 = t64.to(torch.float32)
    if not torch.equal(t32.to(torch.float64), t64):
        raise TicInputError(f"{what}: a logprob is not a float32 value; vLLM's logprobs were post-processed")
    return t32


def sample_from_record(rec: dict) -> Sample:
    """A generation record -> Sample whose logprobs are the sampled tokens' logprobs, bit for bit."""
    ids, lps = rec["token_ids"], rec["logprobs"]
    if lps is None or len(lps) != len(ids):
        raise TicInputError(f"vLLM output for request {rec.get('request_id')}: {0 if lps is None else len(lps)} "
                            f"logprob entries for {len(ids)} tokens (was logprobs=0 set?)")
    vals = []
    for i, (tok, d) in enumerate(zip(ids, lps)):
        key = str(int(tok))
        if key not in d:
            raise TicInputError(f"vLLM output for request {rec.get('request_id')}: position {i} has no logprob "
                                f"for its sampled token {tok}")
        vals.append(d[key])
    return Sample(list(rec["prompt_token_ids"]), list(ids), _exact_f32(vals, "vLLM sample logprobs"),
                  id=rec.get("request_id"), meta={"engine": "vllm"})


def scored_from_record(rec: dict, prompt_len: int) -> torch.Tensor:
    """A prompt_logprobs record of prompt+response -> the logprobs of the response tokens (positions P..)."""
    ids, plp = rec["prompt_token_ids"], rec["prompt_logprobs"]
    if plp is None or len(plp) != len(ids):
        raise TicInputError(f"vLLM scoring output: {0 if plp is None else len(plp)} prompt logprob entries for "
                            f"{len(ids)} tokens (was prompt_logprobs=0 set and prefix caching off?)")
    if not 1 <= prompt_len <= len(ids):
        raise TicInputError(f"prompt length {prompt_len} outside the scored sequence of {len(ids)} tokens")
    vals = []
    for i in range(prompt_len, len(ids)):
        key = str(int(ids[i]))
        if plp[i] is None or key not in plp[i]:
            raise TicInputError(f"vLLM scoring output: position {i} has no logprob for token {ids[i]}")
        vals.append(plp[i][key])
    return _exact_f32(vals, "vLLM prompt logprobs") if vals else torch.zeros(0, dtype=torch.float32)


# -- the engine ------------------------------------------------------------------------------------------------
def _import_vllm(batch_invariant: bool | None, model_runner: str | None = None, own_process: bool = False):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise TicInputError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0: tic runs vLLM in-process")
    if batch_invariant is not None and not own_process:
        want = "1" if batch_invariant else "0"
        import sys

        if "vllm" in sys.modules and os.environ.get("VLLM_BATCH_INVARIANT", "0") != want:
            raise TicInputError("rollout.options.batch_invariant differs from VLLM_BATCH_INVARIANT of the vLLM "
                                "already imported in this process; set it before vLLM is imported")
        os.environ["VLLM_BATCH_INVARIANT"] = want
    if model_runner is not None:
        if model_runner not in ("v1", "v2"):
            raise TicInputError(f"rollout.options.model_runner: {model_runner!r} (expected v1 or v2)")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner == "v2" else "0"
    if not torch.cuda.is_available():
        raise TicInputError("rollout.engine is vllm but torch sees no CUDA GPU (vLLM needs one)")
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401
    except ImportError as e:
        raise TicInputError(f"rollout.engine is vllm but vLLM cannot be imported ({e}); "
                            "install tic[vllm] on a GPU machine") from None
    return vllm


@contextlib.contextmanager
def _own_process_env(patches: list[str], batch_invariant: bool):
    """The environment an engine core of its own starts under: multiprocessing on (spawned: CUDA is live here),
    its patches and its batch-invariant mode; vLLM's env cache (enabled once an in-process engine started) off,
    so vLLM reads them."""
    from tic import patches as tic_patches
    import vllm.envs as envs

    want = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            tic_patches.ENV_VAR: ",".join(patches), "VLLM_BATCH_INVARIANT": "1" if batch_invariant else "0"}
    reset = getattr(envs, "disable_envs_cache", lambda: None)
    reset()
    try:
        with env_overlay(want):
            yield dict(want)
    finally:
        reset()


def _pairs(weights) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a dict or an iterable of pairs (what vLLM's load_weights iterates)."""
    return list(weights.items()) if isinstance(weights, dict) else list(weights)


def _apply_patches(names: list[str]) -> list[str]:
    """The bundled patches of rollout.patches, exactly: set TIC_PATCHES for any process vLLM starts (its plugin
    entry point applies them there) and apply them here, where vLLM may have loaded its plugins already."""
    from tic import patches

    os.environ[patches.ENV_VAR] = ",".join(names)
    patches.apply(names)
    missing = set(names) - set(patches.active())
    if missing:
        raise RuntimeError(f"bundled patches not active after apply: {sorted(missing)}")
    return names


def _start_llm(key: str, kwargs: dict, patch_names: list[str], batch_invariant: bool, own: bool) -> None:
    """Starts the vLLM engine of one configuration (into _LLMS), in this process or, own, an engine core of its
    own started with tic's switch variables."""
    from vllm import LLM

    try:
        if own:
            with _own_process_env(patch_names, batch_invariant) as start_env:
                _LLMS[key] = LLM(**kwargs)
            _START_ENV[key] = start_env
        else:
            _LLMS[key] = LLM(**kwargs)
    except (ValueError, TypeError) as e:
        raise TicInputError(f"vLLM refused the configuration: {str(e).splitlines()[0]}") from None
    # the runner vLLM picked reads the environment as it is now, at the engine's start
    _V2_RUNNER[key] = bool(getattr(_LLMS[key].llm_engine.vllm_config, "use_v2_model_runner", False))


class VLLMEngine(Engine):
    name = "vllm"
    # the consistency switch: batch-invariant mode, tic's bundled patches (rollout.patches -> TIC_PATCHES) and the
    # mode settings that keep the kernels the training side calls (what the baseline leaves at vLLM's defaults)
    switch_keys = ("batch_invariant", "patches", *(f"llm.{k}" for k in MODE_OPTIONS),
                   "effective.compilation_mode", "effective.cudagraph_mode")
    switch_env = ("VLLM_BATCH_INVARIANT", "TIC_PATCHES")
    weight_format = "checkpoint"  # weight sync hands it checkpoint names/layouts, which its loaders map
    effective: dict = {}  # what vLLM made of the options (set once the LLM exists)
    _start_env: dict | None = None  # an engine core of its own: the switch variables it started with
    _weights_changed = False  # C8/C9 synced other weights in: release() restores the checkpoint's
    turns = 0  # generate calls made (under vLLM's DP x EP each is one lockstep turn with the other ranks)

    def __init__(self, model_dir: Path, dtype: str, options: dict, batch_size: int, max_positions: int,
                 vocab_size: int, patch_names: list[str] | None = None, tp: int = 1, ep: int = 1, dp: int = 1,
                 dcp: int = 1):
        self.opts = check_options(options)
        if dp > 1 and os.environ.get("VLLM_DP_SIZE") != str(dp):
            # offline vLLM runs one engine per DP rank (VLLM_DP_RANK/SIZE set by tic's rank processes,
            # tic.harness.engines.vllm_ranks); this in-process engine is one of them
            raise TicInputError(f"rollout.parallel.dp={dp}: the in-process vllm engine runs one DP rank; "
                                "data parallel runs one engine process per rank (tic.harness.engines.vllm_ranks)")
        if ep not in (1, dp * tp):
            raise TicInputError(f"rollout.parallel.ep={ep}: vLLM's expert parallel spans all DP x TP ranks "
                                f"(ep = {dp * tp} here, or 1)")
        own = self.opts["engine_process"] == "own"
        vllm = _import_vllm(self.opts["batch_invariant"], self.opts["model_runner"], own)
        # an engine core of its own applies its patches at start (tic's plugin entry point reads TIC_PATCHES)
        self.patches = list(patch_names or []) if own else _apply_patches(list(patch_names or []))
        self.vllm_version = vllm.__version__
        self.model_dir = Path(model_dir)
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        o = self.opts
        self.batch_invariant = (bool(o["batch_invariant"]) if own and o["batch_invariant"] is not None
                                else os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1")
        self.max_model_len = context_length(o, max_positions)
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype=dtype, seed=o["seed"],
            enforce_eager=o["enforce_eager"], gpu_memory_utilization=o["gpu_memory_utilization"],
            max_model_len=self.max_model_len, logprobs_mode=o["logprobs_mode"],
            enable_prefix_caching=o["enable_prefix_caching"], tensor_parallel_size=tp)
        if ep > 1:
            kwargs["enable_expert_parallel"] = True
        if dcp > 1:
            kwargs["decode_context_parallel_size"] = dcp
        for k in ("attention_backend", "kv_cache_memory_bytes", "kv_cache_dtype", "enable_chunked_prefill",
                  "max_num_batched_tokens", "max_num_seqs", "async_scheduling", "ir_op_priority",
                  "mamba_ssm_cache_dtype"):
            if o[k] is not None:
                kwargs[k] = o[k]
        comp = o["compilation_config"]
        if o["cudagraph_mode"] is not None:
            comp = dict(comp or {}) if not isinstance(comp, int) else {"mode": comp}
            comp["cudagraph_mode"] = o["cudagraph_mode"]
        if comp is not None:
            kwargs["compilation_config"] = comp
        self.llm_kwargs = kwargs
        key = json.dumps({**kwargs, "tic_patches": self.patches, "process": o["engine_process"],
                          "batch_invariant": self.batch_invariant, "model_runner": o["model_runner"]},
                         sort_keys=True, default=str)
        if key not in _LLMS:
            _start_llm(key, kwargs, self.patches, self.batch_invariant, own)
        self.llm = _LLMS[key]
        self._start_env = _START_ENV.get(key)
        vcfg = self.llm.llm_engine.vllm_config
        cc = vcfg.compilation_config
        # what vLLM made of the options (it overrides some, e.g. CUDA graphs under enforce_eager)
        self.effective = {"compilation_mode": str(getattr(cc, "mode", None)),
                          "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
                          "engine_process": o["engine_process"]}
        sched = vcfg.scheduler_config
        # the KV page size vLLM resolved for this engine: a training side on vLLM's kernels is built with it and
        # lays its prefill K/V out in the same pages (FA3 picks its key tile from the paging)
        self.kv_block_size = int(getattr(vcfg.cache_config, "block_size", 0) or DEFAULT_KV_BLOCK_SIZE)
        # with the logprob rule of the runner vLLM picked (its V1 and V2 runners compute logprobs apart): what a
        # training side on vLLM's kernels must match of this engine (its provider is built with it)
        self.rollout_kernels = RolloutKernels.of_runner(self.kv_block_size, _V2_RUNNER[key])
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self._record = Path(o["record"]) if o["record"] else None
        self._call = 0

    @staticmethod
    def config_kwargs(side_cfg: EngineConfig, model: ModelFacts, resolve: Callable[[Path], Path]) -> dict:
        """The engine's arguments from a rollout config, all but the layout (one engine, or each rank's);
        resolve: a path as tic.yaml writes it (options.record) -> the file it names."""
        opts = dict(side_cfg.options)
        if opts.get("record"):
            opts["record"] = str(resolve(Path(opts["record"])))
        return dict(model_dir=model.dir, dtype=model.dtype, options=opts, batch_size=side_cfg.batch_size,
                    max_positions=model.max_positions, vocab_size=model.vocab_size, patch_names=list(side_cfg.patches))

    @classmethod
    def from_config(cls, side_cfg: EngineConfig, model: ModelFacts, resolve: Callable[[Path], Path]) -> "VLLMEngine":
        p = side_cfg.parallel
        return cls(**cls.config_kwargs(side_cfg, model, resolve), tp=p.tp, ep=p.ep, dp=p.dp, dcp=p.dcp)

    @classmethod
    def baseline_changes(cls, side_cfg) -> dict:
        """vLLM as users run it: its own compilation and CUDA-graph defaults, no batch-invariant mode, no patches
        (the consistency switch off); every other option as configured."""
        options = {k: v for k, v in side_cfg.options.items() if k not in MODE_OPTIONS}
        return {"options": {**options, "enforce_eager": False, "batch_invariant": False}, "patches": []}

    @classmethod
    def capture_changes(cls, side_cfg) -> dict:
        """Eager, in this process, on the V1 runner: no torch.compile and no CUDA graphs, which replay kernels
        without running module hooks, and the runner whose per-step layout maps rows to requests (vLLM picks V2
        for dense models). The patches, the IR op priorities and the rest of compilation_config (custom_ops)
        stay."""
        o = {**OPTIONS, **side_cfg.options}
        if o["enforce_eager"] is True and o["engine_process"] == "inline" and o["model_runner"] == "v1":
            return {}
        options = {k: v for k, v in side_cfg.options.items() if k != "cudagraph_mode"}
        comp = _compilation(o)
        if comp:
            options["compilation_config"] = {**{k: v for k, v in comp.items() if k != "level"}, "mode": 0,
                                             "cudagraph_mode": "NONE"}
        if o["engine_process"] != "inline":
            options["engine_process"] = "inline"
        return {"options": {**options, "enforce_eager": True, "model_runner": "v1"}}

    def process_environment(self) -> dict:
        """An engine core of its own runs with the patches and switch variables it started with, whatever this
        process has applied or set since (C1/C10 fingerprint that, not this process's state)."""
        if self._start_env is None:
            return {}
        return {"env": dict(self._start_env), "patches": list(self.patches)}

    @classmethod
    def perf_changes(cls, side_cfg) -> dict:
        """C1/C10 sides each get an engine core process of their own: patches and batch-invariant mode are
        process-wide, so a baseline and a consistent side can only be measured in one run that way."""
        return {"options": {**side_cfg.options, "engine_process": "own"}}

    def fingerprint(self) -> dict:
        return {"engine": self.name, "vllm": self.vllm_version, "batch_invariant": self.batch_invariant,
                "patches": list(self.patches), "effective": dict(self.effective),
                "batch_size": self.batch_size,
                "llm": {k: v if isinstance(v, (int, float, bool, str, type(None))) else json.dumps(v, default=str)
                        for k, v in self.llm_kwargs.items()}}

    # -- C8/C9: in-place weight sync through vLLM's own loaders --------------------------------------------------
    def _on_model(self, fn):
        """fn(model) on the one worker's model (LLM.apply_model); weight sync covers tp = dp = 1."""
        out = self.llm.apply_model(fn)
        if len(out) != 1:
            raise TicInputError(f"weight sync on vllm covers one worker; this engine has {len(out)}")
        return out[0]

    def weight_storage(self) -> dict[str, tuple[int, tuple, str]]:
        return self._on_model(lambda m: {n: (p.data_ptr(), tuple(p.shape), str(p.dtype))
                                         for n, p in m.named_parameters()})

    def load_weights_inplace(self, weights, version: int) -> dict:
        """The trainer's (HF-named) tensors through the model's own `load_weights`: vLLM's weight loaders copy
        each one into its slice of the existing (fused) parameter, so the addresses CUDA graphs captured keep
        serving. The prefix cache is reset: its KV blocks were computed under the old weights."""
        items = _pairs(weights)
        load_into = self._loader()

        def load(model):
            loaded = load_into(model, items)
            return sorted(loaded) if loaded is not None else []

        loaded = self._on_model(load)
        self.llm.reset_prefix_cache()
        self.weight_version = version
        self._weights_changed = True
        return {"copied": len(items), "loaded_parameters": len(loaded), "refreshed": [], "version": version,
                "prefix_cache": "reset"}

    def _loader(self):
        """How the trainer's tensors reach the live parameters. An unquantized model's own loaders copy each
        tensor into its slice of the existing parameter. A quantized model's layers replaced their parameters
        after loading (FP8 codes requantized, scales converted, layouts changed; the loaders are gone), so its
        weights go through vLLM's layerwise reload, the path of its own weight-transfer engines: each layer is
        rebuilt from the checkpoint tensors, processed again, and copied into the same storage."""
        if getattr(self.llm.model_config, "quantization", None) is None:
            return lambda model, items: model.load_weights(iter(items))
        model_config = self.llm.model_config

        def reload(model, items):
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                  initialize_layerwise_reload)

            initialize_layerwise_reload(model)
            loaded = model.load_weights(iter(items))
            finalize_layerwise_reload(model, model_config)
            return loaded

        return reload

    def unequal_weights(self, weights) -> list[str]:
        """vLLM parameters that are not bitwise what `weights` load into. The trainer's tensors go the sync's
        way (the model's loaders, or vLLM's layerwise reload for a quantized model) into scratch copies of every
        parameter (NaN-filled) and buffer, which are then compared with the live ones; a parameter the trainer's
        weights do not reach counts as unequal. vLLM's fusions, layouts and quantization are thereby handled by
        vLLM itself, for any architecture."""
        items = _pairs(weights)
        load_into = self._loader()

        def check(model):
            params = dict(model.named_parameters())
            live = {n: p.data for n, p in params.items()}
            scratch = {n: (torch.full_like(t, float("nan")) if t.is_floating_point() else t.clone())
                       for n, t in live.items()}
            # buffers too: a quantized layer's reprocessing writes its buffers (scales) in place
            buffers = dict(model.named_buffers())
            live_buffers = {n: b.data for n, b in buffers.items()}
            try:
                for n, p in params.items():
                    p.data = scratch[n]
                for n, b in buffers.items():
                    b.data = b.data.clone()
                load_into(model, items)
            finally:
                for n, p in params.items():
                    p.data = live[n]
                for n, b in buffers.items():
                    b.data = live_buffers[n]
            bad = []
            for n, t in live.items():
                got = scratch[n]
                if got.is_floating_point() and bool(torch.isnan(got).any()) and not bool(torch.isnan(t).any()):
                    bad.append(f"{n} (not reached by the trainer's weights)")
                elif not torch.equal(got, t):
                    bad.append(n)
            return sorted(bad)

        return self._on_model(check)

    def release(self) -> None:
        """After C8/C9 changed this engine's weights in place: the checkpoint's weights back (the LLM is shared
        by every gate of this process with the same configuration)."""
        if not self._weights_changed:
            return
        from safetensors.torch import load_file

        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise TicInputError(f"cannot restore the rollout weights: no safetensors in {self.model_dir}")
        self.load_weights_inplace({k: v for f in files for k, v in load_file(str(f)).items()}, 0)
        self._weights_changed = False

    # -- helpers -------------------------------------------------------------------------------------------
    def _check(self, seqs: list[list[int]], extra: int) -> None:
        for s in seqs:
            if not s:
                raise TicInputError("empty prompt")
            if min(s) < 0 or max(s) >= self.vocab_size:
                raise TicInputError(f"token id outside the vocabulary (size {self.vocab_size}): {s}")
            if len(s) + extra > self.max_model_len:
                raise TicInputError(f"sequence of {len(s)}+{extra} tokens exceeds max_model_len "
                                    f"{self.max_model_len}")

    def _sampling_params(self, sampling: Sampling, rid: int):
        from vllm import SamplingParams

        if sampling.temperature not in (0, 1) and self.opts["logprobs_mode"] == "raw_logprobs":
            raise TicInputError(f"sampling.temperature {sampling.temperature}: vLLM raw logprobs (and "
                                "prompt_logprobs) are taken before temperature, the train side after it; use "
                                "temperature 1 (or 0) with vllm")
        return SamplingParams(n=1, temperature=sampling.temperature, top_p=1.0, top_k=0,
                              max_tokens=sampling.max_tokens, seed=request_seed(sampling.seed, rid),
                              logprobs=0, ignore_eos=True, detokenize=False)

    def _run(self, prompts: list[list[int]], params: list, kind: str, rids: list) -> list[dict]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        self._call += 1
        self.turns += 1
        recs = [output_record(o, kind, r) for o, r in zip(outs, rids)]
        for rec, p in zip(recs, prompts):
            if rec["prompt_token_ids"] != list(p):
                raise TicInputError("vLLM returned outputs out of order (prompt ids differ)")
        if self._record is not None:
            from tic.core.fsio import atomic_write_text

            old = self._record.read_text() if self._record.is_file() else ""
            lines = "".join(json.dumps({**r, "call": self._call, "batch": len(recs), "index": i}) + "\n"
                            for i, r in enumerate(recs))
            atomic_write_text(self._record, old + lines)
        return recs

    # -- interface -----------------------------------------------------------------------------------------
    def generate(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        self._check(prompts, sampling.max_tokens)
        out: list[Sample] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self.generate_together(prompts[i:i + self.batch_size], sampling,
                                          list(request_ids[i:i + self.batch_size]), _kind="generate")
        return out

    def generate_together(self, prompts, sampling: Sampling, request_ids, _kind: str = "together") -> list[Sample]:
        self._check(prompts, sampling.max_tokens)
        self.last_sampling = sampling  # the capture runner reruns the same seeded requests
        if len(prompts) > self.max_num_seqs:
            raise TicInputError(f"{len(prompts)} requests cannot share one vLLM batch (max_num_seqs "
                                f"{self.max_num_seqs})")
        params = [self._sampling_params(sampling, r) for r in request_ids]
        recs = self._run(prompts, params, _kind, list(request_ids))
        out = []
        for rec in recs:
            s = sample_from_record(rec)
            s.weight_version = self.weight_version  # C8: the weight version these tokens were sampled under
            s.meta.update({"batch_invariant": self.batch_invariant, "vllm": self.vllm_version})
            out.append(s)
        return out

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        from vllm import SamplingParams

        seqs = [s.ids for s in samples]
        self._check(seqs, 1)
        out: list[torch.Tensor] = []
        for i in range(0, len(samples), self.batch_size):
            chunk = samples[i:i + self.batch_size]
            params = [SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                     ignore_eos=True) for _ in chunk]
            recs = self._run([s.ids for s in chunk], params, "score", [s.id for s in chunk])
            out += [scored_from_record(r, len(s.prompt_ids)) for r, s in zip(recs, chunk)]
        return out

    def take_turn(self) -> None:
        """One generate call of a one-token request whose output is dropped (nothing recorded): under vLLM's DP x
        EP every rank steps with the others, so a rank without work of its own still takes its turn (its MoE
        layers serve the other ranks' tokens meanwhile)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=[0])],
                          [SamplingParams(n=1, max_tokens=1, detokenize=False, ignore_eos=True)], use_tqdm=False)
        self.turns += 1

    # -- in-process model access (the locator's capture runner: tic.harness.locate.vllm_capture) -----------------
    def _require_model_here(self, what: str) -> None:
        """Hooks and module replay need vLLM's model in this process. vLLM keeps it here only with its
        single-process executor; under its data parallel (or TP > 1) the model lives in worker processes and
        asking for it would pickle the model runner across (it cannot be: the call fails in the worker and the
        caller waits forever). A RuntimeError, not an input error: a gate's verdict stands, its locator says why."""
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        ex = getattr(self.llm.llm_engine, "model_executor", None)
        if not isinstance(ex, UniProcExecutor):
            raise RuntimeError(f"{what} needs vLLM's model in this process; this engine runs it in worker processes "
                               f"({type(ex).__name__}: vLLM data parallel > 1 or tensor parallel > 1)")

    def model(self) -> torch.nn.Module:
        """The torch module vLLM runs (in this process)."""
        self._require_model_here("the model")
        return self.llm.apply_model(lambda m: m)[0]  # in-process engine: the module itself comes back

    def abort_unfinished(self) -> None:
        """A run broken off mid-step (an exception inside vLLM's step) leaves its requests queued in vLLM; drop
        them so that later runs (the ladder's next gates) see only their own requests."""
        eng = self.llm.llm_engine
        states = getattr(getattr(eng, "output_processor", None), "request_states", None)
        if states:
            eng.abort_request(list(states))

    def model_runner(self):
        self._require_model_here("the model runner")
        return self.llm.collective_rpc(lambda w: getattr(w, "worker", w).model_runner)[0]
