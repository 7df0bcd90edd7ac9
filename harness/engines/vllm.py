"""vLLM rollout engine (vLLM 0.26, V1 engine, in-process) for C3, C4, C5 and the locator.

- Prompts are token ids (TokensPrompt); the tokenizer is skipped (skip_tokenizer_init, detokenize=False).
- Rollout: SamplingParams(seed=per request, logprobs=0, ignore_eos=True); each sampled token's logprob is read
  exactly as vLLM reports it (logprobs_mode raw_logprobs by default: log_softmax of the raw logits in float32).
- Scoring (C4's prefill side): the whole sequence as one prompt with prompt_logprobs=0 and max_tokens=1.
- generate_together submits all requests in one call, sized so that vLLM's scheduler runs them in one batch.
- Capture (locator): forward hooks on the model inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0);
  a vLLM decoder layer returns (hidden, residual) apart, the common per-layer output is hidden + residual.

vLLM is imported only when an engine is built; the record conversions below need only torch, so the CPU
tests exercise them on records saved from a real device run.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from tic.core.env import env_overlay
from tic.harness.engines.base import Engine, Sample, Sampling, request_seed
from tic.core.errors import TicInputError

# rollout.options understood by this engine, with their defaults.
OPTIONS: dict[str, Any] = {
    "enforce_eager": True,            # no torch.compile, no CUDA graphs (hooks for capture need eager)
    "attention_backend": None,        # e.g. FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER (None: vLLM picks)
    "batch_invariant": None,          # True/False sets VLLM_BATCH_INVARIANT before vLLM is imported; None: env
    "gpu_memory_utilization": 0.3,
    "kv_cache_memory_bytes": None,    # set to skip vLLM's memory profiling (several engines on one GPU)
    "max_model_len": None,            # None: min(max_position_embeddings, 2048)
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
REPLACES_BATCH_INVARIANT = ("fa3-fixed-tile", "rmsnorm-fixed-block", "gemm-fixed-m")


def _priority_list(value) -> list[str]:
    """An IR op priority as vLLM reads it: a list of implementation names, or one comma-separated string."""
    if isinstance(value, str):
        return [v for v in value.replace(" ", "").split(",") if v]
    return [str(v) for v in value or []]


def compiles_with_inductor(options: dict) -> bool:
    """Whether vLLM compiles the model with Inductor under these options: not enforce_eager and a compilation
    mode above NONE (vLLM's default when none is given is VLLM_COMPILE) on the inductor backend."""
    o = {**OPTIONS, **options}
    if o["enforce_eager"]:
        return False
    comp = o["compilation_config"]
    comp = {"mode": comp} if isinstance(comp, (int, str)) else dict(comp or {})
    mode = comp.get("mode", comp.get("level", 3))
    return str(mode).upper() not in ("0", "NONE") and str(comp.get("backend") or "inductor") == "inductor"


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
        self.max_model_len = o["max_model_len"] or min(max_positions, 2048)
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype=dtype, seed=o["seed"],
            enforce_eager=o["enforce_eager"], gpu_memory_utilization=o["gpu_memory_utilization"],
            max_model_len=self.max_model_len, logprobs_mode=o["logprobs_mode"],
            enable_prefix_caching=o["enable_prefix_caching"], tensor_parallel_size=tp)
        if ep > 1:
            kwargs["enable_expert_parallel"] = True
        if dcp > 1:
            kwargs["decode_context_parallel_size"] = dcp
        for k in ("attention_backend", "kv_cache_memory_bytes", "enable_chunked_prefill",
                  "max_num_batched_tokens", "max_num_seqs", "async_scheduling", "ir_op_priority"):
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
                          "batch_invariant": self.batch_invariant}, sort_keys=True, default=str)
        if key not in _LLMS:
            from vllm import LLM

            try:
                if own:
                    with _own_process_env(self.patches, self.batch_invariant) as start_env:
                        _LLMS[key] = LLM(**kwargs)
                    _START_ENV[key] = start_env
                else:
                    _LLMS[key] = LLM(**kwargs)
            except (ValueError, TypeError) as e:
                raise TicInputError(f"vLLM refused the configuration: {str(e).splitlines()[0]}") from None
        self.llm = _LLMS[key]
        self._start_env = _START_ENV.get(key)
        vcfg = self.llm.llm_engine.vllm_config
        cc = vcfg.compilation_config
        # what vLLM made of the options (it overrides some, e.g. CUDA graphs under enforce_eager)
        self.effective = {"compilation_mode": str(getattr(cc, "mode", None)),
                          "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
                          "engine_process": o["engine_process"]}
        sched = vcfg.scheduler_config
        # the KV page size this engine runs: tic's training provider lays its prefill K/V out in the same pages
        # (FA3 picks its key tile from the paging), in this process and in a later one reading the record
        self.kv_block_size = int(getattr(vcfg.cache_config, "block_size", 0) or 16)
        os.environ["TIC_VLLM_BLOCK_SIZE"] = str(self.kv_block_size)
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self._record = Path(o["record"]) if o["record"] else None
        self._call = 0

    @staticmethod
    def config_kwargs(side_cfg, ctx) -> dict:
        """The engine's arguments from a rollout config, all but the layout (one engine, or each rank's)."""
        c = ctx.model_config
        text = c.get("text_config", c)
        opts = dict(side_cfg.options)
        if opts.get("record"):
            opts["record"] = str(ctx.cfg.resolve(Path(opts["record"])))
        return dict(model_dir=ctx.model_dir, dtype=ctx.dtype, options=opts, batch_size=side_cfg.batch_size,
                    max_positions=int(text.get("max_position_embeddings", 2048)), vocab_size=ctx.vocab_size,
                    patch_names=list(side_cfg.patches))

    @classmethod
    def from_config(cls, side_cfg, ctx) -> "VLLMEngine":
        p = side_cfg.parallel
        return cls(**cls.config_kwargs(side_cfg, ctx), tp=p.tp, ep=p.ep, dp=p.dp, dcp=p.dcp)

    @classmethod
    def baseline_changes(cls, side_cfg) -> dict:
        """vLLM as users run it: its own compilation and CUDA-graph defaults, no batch-invariant mode, no patches
        (the consistency switch off); every other option as configured."""
        options = {k: v for k, v in side_cfg.options.items() if k not in MODE_OPTIONS}
        return {"options": {**options, "enforce_eager": False, "batch_invariant": False}, "patches": []}

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

        def load(model):
            loaded = model.load_weights(iter(items))
            return sorted(loaded) if loaded is not None else []

        loaded = self._on_model(load)
        self.llm.reset_prefix_cache()
        self.weight_version = version
        self._weights_changed = True
        return {"copied": len(items), "loaded_parameters": len(loaded), "refreshed": [], "version": version,
                "prefix_cache": "reset"}

    def unequal_weights(self, weights) -> list[str]:
        """vLLM parameters that are not bitwise what `weights` load into. The trainer's tensors go through the
        model's own loaders into scratch copies of every parameter (NaN-filled), which are then compared with
        the live ones; a parameter the trainer's weights do not reach counts as unequal. vLLM's fusions and
        layouts are thereby handled by vLLM itself, for any architecture."""
        items = _pairs(weights)

        def check(model):
            params = dict(model.named_parameters())
            live = {n: p.data for n, p in params.items()}
            scratch = {n: (torch.full_like(t, float("nan")) if t.is_floating_point() else t.clone())
                       for n, t in live.items()}
            try:
                for n, p in params.items():
                    p.data = scratch[n]
                model.load_weights(iter(items))
            finally:
                for n, p in params.items():
                    p.data = live[n]
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

    def capture_runner(self, temperature: float):
        """The locator's CaptureRunner for this engine (tic.harness.locate.capture); see VLLMCaptureRunner."""
        return VLLMCaptureRunner(self, temperature)

    # -- in-process model access (locator capture) -----------------------------------------------------------
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

    def model_runner(self):
        self._require_model_here("the model runner")
        return self.llm.collective_rpc(lambda w: getattr(w, "worker", w).model_runner)[0]


# -- the locator's capture runner (tic.harness.locate.capture.CaptureRunner) ------------------------------------------
# vLLM runs every step as one flat batch of token rows [num_tokens, ...] with a positions tensor; the V1 GPU model
# runner's input batch says which rows belong to which request (query_start_loc). A step's rows of the compared
# request are mapped to (request, position) when the step starts (a pre-hook on the embedding), and every hooked
# module keeps, or replaces, just those rows, keyed by position - the same keys the HF runner uses, so vLLM can be
# compared with itself (C3, C4) or with HF (C5) by stable module names.
#
# Stable per-layer values: a vLLM decoder layer takes and returns (hidden, residual) apart; the residual stream HF
# carries is hidden + residual (in the model dtype, as the next fused add-RMSNorm forms it). So a layer's (and an
# add-norm's) recorded input is (hidden + residual, hidden, residual): HF replays the first, vLLM replays the
# two raw parts (exact). Its output is hidden + residual (layers) or the normed value (norms).
#
# Teacher-forced decode: the same seeded requests are rerun in the same batch (vLLM samples per request with its
# own seed, so the tokens are reproduced; checked up to the compared position). Scoring step by step with
# prompt+prefix would run prefill kernels, not decode, and so would not be the computation the gate measured.


def _float_rows(x, n: int) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1 and x.shape[0] == n


def _signature(module):
    """The forward's named signature; vLLM's CustomOps (RMSNorm, ...) forward(*args, **kwargs) to forward_native
    & co., whose signature names the parameters (x, residual)."""
    import inspect

    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for attr in ("forward", "forward_native", "forward_cuda"):
        f = getattr(module, attr, None)
        if f is None:
            continue
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            continue
        if not any(p.kind in var for p in sig.parameters.values()):
            return sig
    return None


def _bind_call(module, args, kwargs) -> tuple[list[tuple[str, Any]], bool]:
    """(parameter name, value) of a call in the forward's parameter order, and whether the names come from its
    signature; without one (forward(*args, **kwargs) all the way down), positional arguments are named by
    their index ("0", "1", ...) and keyword arguments by their keyword."""
    sig = _signature(module)
    if sig is not None:
        try:
            return list(sig.bind(*args, **kwargs).arguments.items()), True
        except TypeError:
            pass
    return [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items()), False


def _bind(module, args, kwargs) -> list[tuple[str, Any]]:
    return _bind_call(module, args, kwargs)[0]


def flat_inputs(module, args, kwargs, n: int) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """The token-row float inputs of a call [(key, tensor)], and the name of its residual input if it has one.

    Keys name the argument, positional or keyword alike; a tensor inside a tuple/list argument (e.g. the
    (cos, sin) of `position_embeddings`) is keyed "name.j". Top-level arguments come first, in parameter order,
    so the first input is the hidden state as other engines' replays take it."""
    bound = _bind(module, args, kwargs)
    rows = [(k, v) for k, v in bound if _float_rows(v, n)]
    res = "residual" if any(k == "residual" for k, _ in rows) else None
    rows += [(f"{k}.{j}", x) for k, v in bound if isinstance(v, (list, tuple))
             for j, x in enumerate(v) if _float_rows(x, n)]
    return rows, res


def stable_inputs(rows: list[tuple[str, torch.Tensor]], res: str | None) -> list[torch.Tensor]:
    """Per-token input tensors as compared/replayed: (x + residual, x, residual) for add-norm calls."""
    if res is not None and len(rows) == 2:
        x = next(v for k, v in rows if k != res)
        r = next(v for k, v in rows if k == res)
        return [x + r, x, r]
    return [v for _, v in rows]


def stable_outputs(is_layer: bool, out, n: int) -> list[torch.Tensor]:
    """Per-token output as compared: a layer's hidden + residual, else the first token-row tensor."""
    if is_layer and isinstance(out, tuple) and len(out) == 2:
        h, r = out
        return [h if r is None else h + r]
    ts = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, (tuple, list)) else [])
                                                      if isinstance(t, torch.Tensor)]
    ts = [t for t in ts if _float_rows(t, n)]
    return ts[:1]


def _recorded_row(got, key: str, k: int, own_keys: list[str]):
    """The recorded row that replaces input `key` (the call's k-th token-row input), or None.

    Rows that name their arguments (InputRows, e.g. from the HF runner) replace the input of the same name; rows
    whose names match none of this call's inputs (another engine's module signature) replace the hidden state
    (the first input) only. Plain rows (this runner's own records) go by input order, which the same module's
    call gives both sides."""
    keys = getattr(got, "keys", None)
    if keys:
        if key in keys:
            return got[keys.index(key)]
        return got[0] if k == 0 and not any(o in keys for o in own_keys) else None
    return got[k] if k < len(got) else None


def replace_rows(module, args, kwargs, n: int, targets: list[tuple[int, int]], repl: dict) -> tuple[tuple, dict]:
    """args/kwargs with the compared request's rows of every token-row input (positional, keyword, or inside a
    tuple argument) replaced by the other side's recorded rows. A row of another shape is left as it is."""
    bound, named = _bind_call(module, args, kwargs)
    rows, res = flat_inputs(module, args, kwargs, n)
    new = {k: v for k, v in bound}
    if res is not None and len(rows) == 2:
        x_name = next(k for k, _ in rows if k != res)
        xs, rs = new[x_name].clone(), new[res].clone()
        for i, pos in targets:
            got = repl.get(pos)
            if got is None:
                continue
            if len(got) == 3:      # vLLM's own (sum, hidden, residual): replay the two parts exactly
                xs[i], rs[i] = got[1].to(xs.device, xs.dtype), got[2].to(rs.device, rs.dtype)
            else:                  # the residual stream from another engine: hidden = it, residual = 0
                xs[i] = got[0].to(xs.device, xs.dtype)
                rs[i] = 0
        new[x_name], new[res] = xs, rs
    else:
        own = [key for key, _ in rows]
        for k, (key, v) in enumerate(rows):
            v, changed = v.clone(), False
            for i, pos in targets:
                got = repl.get(pos)
                row = None if got is None else _recorded_row(got, key, k, own)
                if row is None or tuple(row.shape) != tuple(v[i].shape):
                    continue
                v[i] = row.to(v.device, v.dtype)
                changed = True
            if not changed:
                continue
            head, _, j = key.partition(".")
            if j:  # a member of a tuple/list argument: a new container of the same type
                seq = list(new[head])
                seq[int(j)] = v
                new[head] = type(new[head])(seq)
            else:
                new[key] = v
    if not named:  # no signature to bind to: positional as given, keywords by keyword
        return tuple(new[str(i)] for i in range(len(args))), {k: new[k] for k in kwargs}
    import inspect

    params = _signature(module).parameters
    pos_names = [p for p in params if params[p].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    out_args = tuple(new[p] for p in pos_names[:len(args)])
    out_kwargs = {k: new[k] for k in new if k not in pos_names[:len(args)]}
    return out_args, out_kwargs


class VLLMCaptureRunner:
    """CaptureRunner over a VLLMEngine (in-process, V1 GPU model runner, eager)."""

    def __init__(self, engine: "VLLMEngine", temperature: float = 1.0):
        if engine.opts["enforce_eager"] is not True:
            raise TicInputError("capture on vllm needs rollout.options.enforce_eager: true (CUDA graphs and "
                                "torch.compile replay kernels without running module hooks)")
        if engine.opts.get("engine_process", "inline") != "inline":
            raise TicInputError("capture on vllm needs rollout.options.engine_process: inline (module hooks run "
                                "in the engine core's process)")
        runner = engine.model_runner()
        if not (hasattr(runner, "input_batch") and hasattr(runner, "query_start_loc")):
            raise TicInputError("capture on vllm needs its V1 GPU model runner (per-step request layout); this "
                                "engine runs the V2 runner: set rollout.options.model_runner: v1")
        self.engine, self.runner, self.temperature = engine, runner, temperature
        self.model = engine.model()
        self.modules = dict(self.model.named_modules())
        self.layers = [n for n in self.modules if n.count(".") == 2 and n.split(".")[-2] == "layers"
                       and n.split(".")[-1].isdigit()]
        self.prefix = self.layers[0].rsplit(".", 2)[0] if self.layers else "model"
        self._layer_set = set(self.layers)

    @property
    def repro_setup(self) -> list[str]:
        """vLLM's batch-invariant mode swaps aten kernels (softmax, mean, ...) and cuBLAS settings for the whole
        process, the train side's too: a repro must switch it on the same way before it runs anything."""
        if not self.engine.batch_invariant:
            return []
        return ["import os", "os.environ['VLLM_BATCH_INVARIANT'] = '1'",
                "from vllm.model_executor.layers.batch_invariant import init_batch_invariance",
                "init_batch_invariance()"]

    # names (the same stable names as the HF runner: embed_tokens, layers.<i>, norm; vLLM has no model-level
    # rotary module and computes the head's logits outside a module call on a row subset, so neither is a stage)
    def stages(self) -> list[str]:
        pre = [n for n in (f"{self.prefix}.embed_tokens",) if n in self.modules]
        post = [n for n in (f"{self.prefix}.norm",) if n in self.modules]
        return pre + self.layers + post

    def children(self, name: str) -> list[str]:
        return [f"{name}.{c}" if name else c for c, _ in self.modules[name].named_children()]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.modules if n.startswith(name + ".")]

    # the step's rows of the compared request
    def _step_targets(self, prompt: tuple[int, ...], n: int) -> list[tuple[int, int]]:
        r = self.runner
        k = r.input_batch.num_reqs
        qsl = r.query_start_loc.np[:k + 1]
        hit = [i for i, rid in enumerate(r.input_batch.req_ids[:k])
               if tuple(int(t) for t in r.requests[rid].prompt_token_ids) == prompt]
        if len(hit) > 1:
            raise RuntimeError("capture: the compared prompt occurs twice in one vLLM step")
        if not hit:
            return []
        a, b = int(qsl[hit[0]]), int(qsl[hit[0] + 1])
        if b > n:
            raise RuntimeError(f"capture: request rows {a}:{b} outside the step's {n} token rows")
        pos = r.positions[a:b].detach().cpu().tolist() if isinstance(r.positions, torch.Tensor) else \
            r.positions.np[a:b].tolist()
        return [(a + j, int(p)) for j, p in enumerate(pos)]

    def _run(self, prompts, params, kind, rids, probe: int, spec):
        from tic.harness.locate.capture import Capture
        from tic.harness.locate.recorder import OpRecorder
        from tic.harness.locate.trail import Trail
        from tic.harness.locate.provenance import Provenance

        prompt = tuple(int(t) for t in prompts[probe])
        cap = Capture()
        st: dict[str, Any] = {"targets": [], "n": 0, "rec": None, "err": None}
        names = set(spec.outputs) | set(spec.inputs) | set(spec.replace)
        if spec.trail_module:
            names.add(spec.trail_module)
        embed = self.modules[f"{self.prefix}.embed_tokens"]

        def guarded(fn):
            """A hook that fails must not abort vLLM's step (its requests would stay queued): the error is
            kept, capture stops, and it is raised once vLLM has finished the run."""
            def g(*a):
                if st["err"] is not None:
                    return None
                try:
                    return fn(*a)
                except Exception as e:  # noqa: BLE001
                    st["err"], st["targets"] = e, []
                    return None
            return g

        def step(mod, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            st["n"] = int(ids.shape[0])
            st["targets"] = self._step_targets(prompt, st["n"])
            if st["targets"]:
                cap.forwards += 1

        def keep(store, ts, targets):
            if not ts or not targets:
                return
            idx = torch.tensor([i for i, _ in targets], dtype=torch.long, device=ts[0].device)
            got = [t.detach().index_select(0, idx).cpu() for t in ts]
            for j, (_, pos) in enumerate(targets):
                store[pos] = tuple(g[j].clone() for g in got)

        def pre(name):
            mod = self.modules[name]

            def fn(module, args, kwargs):
                targets, n = st["targets"], st["n"]
                if not targets:
                    return None
                if name not in cap.order:
                    cap.order.append(name)
                new = None
                if name in spec.replace:
                    new = replace_rows(mod, args, kwargs, n, targets, spec.replace[name])
                    args, kwargs = new
                if name in spec.inputs:
                    rows, res = flat_inputs(mod, args, kwargs, n)
                    keep(cap.inputs.setdefault(name, {}), stable_inputs(rows, res), targets)
                if (name == spec.trail_module and st["rec"] is None and cap.trail is None
                        and any(p == spec.trail_position for _, p in targets)):
                    fi = next(i for i, p in targets if p == spec.trail_position)
                    cap.trail = Trail([], 1, n, fi)
                    prov = Provenance(1, n)
                    for v in list(args) + list(kwargs.values()):
                        prov.seed(v)  # the step's token-row inputs: tokens of the trail's values follow from them
                    st["rec"] = OpRecorder(cap.trail.calls, cap.trail.errors, provenance=prov)
                    st["rec"].__enter__()
                return new
            return fn

        def post(name):
            is_layer = name in self._layer_set

            def fn(module, args, kwargs, out):
                if name == spec.trail_module and st["rec"] is not None:
                    st["rec"].__exit__(None, None, None)
                    st["rec"] = None
                if name in spec.outputs and st["targets"]:
                    keep(cap.outputs.setdefault(name, {}), stable_outputs(is_layer, out, st["n"]), st["targets"])
                return None
            return fn

        handles = [embed.register_forward_pre_hook(guarded(step), with_kwargs=True)]
        try:
            for name in sorted(names):
                m = self.modules.get(name)
                if m is None:
                    continue
                handles.append(m.register_forward_pre_hook(guarded(pre(name)), with_kwargs=True))
                handles.append(m.register_forward_hook(guarded(post(name)), with_kwargs=True))
            try:
                recs = self.engine._run(prompts, params, kind, rids)
            except BaseException:
                self._abort_unfinished()
                raise
        finally:
            for h in handles:
                h.remove()
            if st["rec"] is not None:
                st["rec"].__exit__(None, None, None)
        if st["err"] is not None:
            e = st["err"]
            raise RuntimeError(f"capture hook failed: {type(e).__name__}: {e}") from e
        return cap, recs[probe]

    def _abort_unfinished(self) -> None:
        """A run broken off mid-step leaves its requests queued in vLLM; drop them so that later runs (the
        ladder's next gates) see only their own requests."""
        eng = self.engine.llm.llm_engine
        states = getattr(getattr(eng, "output_processor", None), "request_states", None)
        if states:
            eng.abort_request(list(states))

    @torch.inference_mode()
    def decode(self, samples, target, upto, spec, together=False):
        eng = self.engine
        sp = getattr(eng, "last_sampling", None)
        if sp is None:
            raise RuntimeError("capture: this vLLM engine has not generated yet (no sampling to rerun)")
        sp = Sampling(temperature=self.temperature, max_tokens=sp.max_tokens, seed=sp.seed)
        bs = len(samples) if together else eng.batch_size
        start = 0 if together else (target // bs) * bs
        batch = samples[start:start + bs]
        tb = target - start
        params = [eng._sampling_params(sp, s.id) for s in batch]
        cap, rec = self._run([s.prompt_ids for s in batch], params, "capture", [s.id for s in batch], tb, spec)
        want = list(batch[tb].response_ids[:upto + 1])
        got = rec["token_ids"][:upto + 1]
        if not spec.replace and got[:upto] != want[:upto]:
            raise RuntimeError(f"capture: vLLM's rerun sampled other tokens than the compared rollout before "
                               f"response position {upto} (rerun not deterministic)")
        for j, tok in enumerate(want):
            d = rec["logprobs"][j] if rec["logprobs"] and j < len(rec["logprobs"]) else None
            if d is not None and j < len(got) and got[j] == tok and str(tok) in d:
                cap.logprobs[j] = _exact_f32([d[str(tok)]], "vLLM capture logprob")[0]
        return cap

    @torch.inference_mode()
    def score(self, samples, target, spec):
        from vllm import SamplingParams

        eng = self.engine
        bs = eng.batch_size
        start = (target // bs) * bs
        chunk = samples[start:start + bs]
        tb = target - start
        params = [SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                 ignore_eos=True) for _ in chunk]
        cap, rec = self._run([s.ids for s in chunk], params, "capture-score", [s.id for s in chunk], tb, spec)
        got = scored_from_record(rec, len(chunk[tb].prompt_ids))
        cap.logprobs = {j: got[j].clone() for j in range(len(got))}
        return cap
