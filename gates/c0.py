"""C0: the target. Inventory of the model's operators, dtypes and quantization; reject what the method
does not cover."""

from __future__ import annotations

import json

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.engines.megatron import refusals as megatron_refusals
from tic.harness.engines.vllm import (backend_refusals, departure_refusals, mode_refusals, recurrent_refusals,
                                      window_refusals)
from tic.harness.measure.fingerprint import installed_version
from tic.harness.model.inventory import build_manifest
from tic.harness.kernels.coverage import KERNELS, coverage_problems, coverage_table, format_table
from tic.harness.model.layer_structure import build_meta
from tic.harness.engines.parallel import COVERED, layout_refusals
from tic.core.fsio import atomic_write_text


def measure(ctx) -> Measurement:
    cfg = ctx.cfg
    rejected, layouts = [], {}
    for side in ("rollout", "train"):
        side_cfg = getattr(cfg, side)
        layouts[side] = side_cfg.parallel.describe()
        options = side_cfg.options if side_cfg.engine == "hf" else None
        rejected += layout_refusals(side, side_cfg.parallel, options, side_cfg.engine,
                                    getattr(side_cfg, "patches", ()))
    if cfg.rollout.engine == "vllm":
        rejected += mode_refusals(cfg.rollout.options,
                                  cfg.train.kernels if cfg.train.engine in ("hf", "megatron") else "stock")
        rejected += recurrent_refusals(ctx.model_config, cfg.rollout.options, cfg.rollout.patches)  # issue 31
        rejected += window_refusals(ctx.model_config, cfg.rollout.options, cfg.rollout.patches)
        rejected += departure_refusals(ctx.model_config, installed_version("vllm"))
        rejected += backend_refusals(ctx.model_config, cfg.rollout.options,
                                     cfg.train.kernels if cfg.train.engine in ("hf", "megatron") else "stock")
    if cfg.train.engine == "megatron":  # the Megatron train engine's own limits (issue 32)
        rejected += megatron_refusals(cfg.train, ctx.model_config)
    coverage = kernel_coverage(cfg, ctx.model_config)
    rejected += coverage["not_covered"]
    if cfg.training.updates_per_step > 1:
        rejected.append(f"training.updates_per_step={cfg.training.updates_per_step}: from the second mini-batch "
                        "on, training weights differ from sampling weights, which diff = 0 does not cover")
    spec = {k for k in cfg.rollout.options if "specul" in k or k == "num_speculative_tokens"}
    if cfg.training.speculative_decoding or spec:
        rejected.append("speculative decoding / MTP: more than one token per request per step is not covered")
    manifest = build_manifest(ctx.model.dir, ctx.model_config)
    path = ctx.artifacts("C0") / "manifest.json"
    atomic_write_text(path, json.dumps(manifest, indent=2))
    notes = []
    if not manifest["family_known"]:
        notes.append(f"model_type {manifest['model_type']!r} has no family entry; classes come from tensor names")
    if manifest["mtp_layers"]:
        notes.append(f"{manifest['mtp_layers']} MTP layer(s) in the checkpoint: keep them off in rollout")
    if cfg.rollout.engine == "vllm" and cfg.rollout.parallel.dp > 1 and cfg.rollout.parallel.ep == 1:
        notes.append(f"rollout.parallel.dp={cfg.rollout.parallel.dp} with ep=1 on vLLM: tic runs independent "
                     "replicas (vLLM's coupled DP would shard each MoE expert over the DP ranks as tensor parallel)")
    return Measurement(
        metrics={"layers": manifest["num_layers"], "operator_classes": len(manifest["operator_classes"]),
                 "rejected": len(rejected)},
        details={"rejected": rejected, "notes": notes, "layouts": layouts, "layouts_covered": COVERED,
                 "kernel_coverage": coverage["table"], "show": coverage["table_lines"],
                 "operator_classes": manifest["operator_classes"],
                 "dtypes": manifest["dtypes"], "quantization_config": manifest["quantization_config"]},
        evidence=[str(path)],
    )


def kernel_coverage(cfg, model_config: dict) -> dict:
    """When a side runs through tic's kernel wrappers (kernels consistent or vllm on an hf engine): the per-layer
    table of what they cover (coverage.py, the model built on the meta device), its text lines, and one refusal
    line per module and operator that side's kernels lack. Nothing otherwise: the table is about the wrappers."""
    wrapped = sorted({getattr(cfg, side).kernels for side in ("rollout", "train")
                      if getattr(cfg, side).engine == "hf" and getattr(cfg, side).kernels in KERNELS})
    if not wrapped:
        return {"table": [], "table_lines": [], "not_covered": []}
    meta_model = build_meta(model_config)
    table = coverage_table(meta_model)
    return {"table": table, "table_lines": ["kernel coverage: " + ln for ln in format_table(table)],
            "not_covered": [f"kernels: {k} does not cover {p}" for k in wrapped
                            for p in coverage_problems(meta_model, k)]}


def judge(m: Measurement) -> Judgement:
    rejected = m.details["rejected"]
    key = f"{m.metrics['layers']} layers, {m.metrics['operator_classes']} operator classes"
    if rejected:
        return Judgement(Verdict.FAIL, "not covered: " + "; ".join(rejected), key)
    if m.metrics["layers"] == 0:
        return Judgement(Verdict.FAIL, "config.json declares no layers", key)
    return Judgement(Verdict.PASS, "inventory written; nothing outside the method's coverage", key)


GATE = Gate(
    id="C0", title="Target inventory", step=1,
    measures="operator classes, dtypes and quantization per layer (config.json + safetensors headers, no weights "
             "loaded); configuration against the method's coverage",
    pass_condition="a manifest with at least one layer is written, and nothing is rejected: no cross-rank "
                   "reduction on the compared path (TP = 1, no decode context parallel, expert outputs merged "
                   "on the owning rank in slot order; DP, EP and training CP are covered), exactly 1 update "
                   "per step, no speculative decoding/MTP; a vLLM rollout neither in batch-invariant mode nor "
                   "compiled with Inductor over the kernels a kernels: vllm training forward calls, nor of a model "
                   "with Mamba-2 mixers unless the mamba-decode-replay patch runs eager or with full decode CUDA "
                   "graphs without torch.compile, nor of a model with Mamba-1 mixers unless the "
                   "mamba1-prefill-steps patch runs in those modes with mamba_ssm_cache_dtype float32, nor of a "
                   "model with Mamba mixers with prefix caching on, nor of a model whose sliding "
                   "window is shorter than the rollout's context without fa3-fixed-tile, nor of a config whose "
                   "fields vLLM's model code overrides or ignores (GLM's partial_rotary_factor, StableLM's use_parallel_residual), nor, "
                   "against a kernels: vllm training forward, of an architecture vLLM runs through its Transformers "
                   "backend",
    inputs=["model.path (config.json, *.safetensors headers)", "rollout/train parallel layouts and options",
            "training"],
    artifacts=["artifacts/C0/manifest.json"], guide="guides/C0.md", reads=("model",),
    measure=measure, judge=judge)
