"""C2: small model cut and wrapper fidelity. A 4-6 layer cut of the full model stands in for it in fast loops
only if it loads, covers every operator class, keeps each kept layer's tensors exactly, and each kept layer
computes exactly what its source layer computes on the same hidden states. When the training side runs through
tic's kernel wrappers (kernels consistent or vllm, train.engine hf or megatron), the wrapped model must also
compute the stock HF model within a stated bound (tic.harness.measure.fidelity): a wrapper that computes another
model would pass C3-C6 bitwise, so it is refused here, before C3."""

from __future__ import annotations

import json

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.harness.model.cut import CUT_RECORD
from tic.harness.engines.hf import WRAPPED_KERNELS, load_model
from tic.harness.measure.fidelity import compare_forward, fidelity_inputs, uneven_constants
from tic.harness.measure import fp8_reference
from tic.harness.model.cut_check import CutRequest, check_cut, cut_dir_for
from tic.core.fsio import atomic_write_text


def cut_request(cfg, state) -> CutRequest:
    """tic.yaml's cut: section; without cut.out, tic's own cut among C2's artifacts in the state directory."""
    return CutRequest.from_config(cfg.cut, cfg.resolve, state.artifacts_dir("C2") / "cut")


def wrapper_fidelity(ctx) -> dict | None:
    """The training side's wrapped model against the stock HF model (eager attention, same weights, dtype and
    device) on seeded inputs; None when the training side does not run through the wrappers. The stock model is the
    model the two sides run: for a block-FP8 checkpoint its quantized linears and experts give the FP8 forward's
    values (activations quantized per token group, the checkpoint's codes times scales), with an FP8 KV cache its
    attention is FlashAttention's FP8 forward (tic.harness.measure.fp8_reference), and its quantizers take the
    activations the wrapped model quantized: a rounding-level difference would otherwise fall on another e4m3 code
    and part by the format's step, which no wrong wrapper causes."""
    train = ctx.cfg.train
    if train.engine not in ("hf", "megatron") or train.kernels not in WRAPPED_KERNELS:
        return None
    engine = ctx.train_engine()
    stock = load_model(engine.model_dir, engine.dtype, "stock", attn="eager", device=str(engine.device),
                       shared=False)
    # a block-FP8 stock model's quantizers take the activations the wrapped model quantized (as C7's reference)
    taken = fp8_reference.QuantizerInputs()
    rules = engine.fp8_rules() if hasattr(engine, "fp8_rules") else {}  # FP8: the deployment's rounding rules
    fp8_reference.follow_deployment(stock, engine.model_dir, str(train.options.get("kv_cache_dtype", "auto")),
                                    taken, rules)
    ids, mask = fidelity_inputs(engine.vocab_size, engine.device)
    view = {"quantizer_inputs": taken}
    if train.engine == "megatron":  # the GPTModel's modules under the checkpoint's names, hidden states [T, B, H]
        view.update(wrapped_modules=engine.model.hf_named_modules(),
                    sequence_first=engine.model.sequence_first_modules())
    found = compare_forward(stock, engine.model, ids, mask, **view)
    if found["first_parting"] is None and train.engine == "hf" and not rules:
        # weights a generated model holds constant can hide a wrong wrapper: once more with them uneven
        with uneven_constants(stock, engine.model) as names:
            if names:
                again = compare_forward(stock, engine.model, ids, mask, **view)
                found["uneven_constants"] = {"parameters": len(names), "first_parting": again["first_parting"]}
                if again["first_parting"]:
                    found.update(first_parting=f"{again['first_parting']}, once the model's constant weights "
                                               f"(norm weights at one, biases at zero) were made uneven",
                                 first_parting_module=again["first_parting_module"])
    return {"kernels": train.kernels, "engine": train.engine,
            **({"fp8_rules": fp8_reference.describe_rules(rules)} if rules else {}), **found}


def measure(ctx) -> Measurement:
    cut_dir = cut_dir_for(cut_request(ctx.cfg, ctx.state), ctx.model.dir, ctx.model_hash)
    r = check_cut(ctx.model.dir, cut_dir)
    fidelity = wrapper_fidelity(ctx)
    if fidelity is not None and fidelity["first_parting"]:
        unread = [k for k, v in fidelity.get("fp8_rules", {}).items() if v.startswith("not identified")]
        why = (f"; the FP8 rounding rule of {', '.join(unread)} was not identified, so the stock model rounds by "
               "tic's default (fidelity.fp8_rules)") if unread else ""
        r["problems"] = [f"fidelity: kernels: {fidelity['kernels']} computes another model than stock HF from "
                         f"{fidelity['first_parting']} ({fidelity['dtype']} bound rtol {fidelity['rtol']:g}){why}; "
                         "guides/extend.md"] + list(r["problems"])
    path = ctx.artifacts("C2") / "check.json"
    atomic_write_text(path, json.dumps({**r, "cut_dir": str(cut_dir), "fidelity": fidelity}, indent=2,
                                       default=str))
    eq = sum(1 for x in r["fidelity"] if x["equal"])
    return Measurement(
        metrics={"kept_layers": len(r["layers"]), "full_layers": r.get("full_layers", 0),
                 "missing_classes": len(r["missing_classes"]), "layers_bitwise_equal": eq,
                 "layers_checked": len(r["fidelity"]), "problems": len(r["problems"])},
        details={"cut_dir": str(cut_dir), "layers": r["layers"], "problems": r["problems"],
                 "missing_transitions": r.get("missing_transitions", []), "explanation": r.get("explanation", []),
                 "notes": r.get("notes", []), "engines_checked": r.get("engines_checked", ["hf"]),
                 "fidelity": fidelity},
        evidence=[str(path), str(cut_dir / CUT_RECORD)],
    )


def judge(m: Measurement) -> Judgement:
    x, d = m.metrics, m.details
    key = (f"layers {d['layers']} of {x['full_layers']}; {x['layers_bitwise_equal']}/{x['layers_checked']} "
           f"layers bitwise equal")
    if d["problems"]:
        more = f" (+{len(d['problems']) - 1} more)" if len(d["problems"]) > 1 else ""
        return Judgement(Verdict.FAIL, d["problems"][0] + more, key)
    if x["layers_checked"] == 0 or x["layers_bitwise_equal"] != x["layers_checked"]:
        return Judgement(Verdict.FAIL, "no kept layer was checked for fidelity", key)
    return Judgement(Verdict.PASS, "cut loads, covers every operator class, keeps each layer's tensors, and every kept "
                                   "layer is bitwise equal to its source on the same hidden states", key)


GATE = Gate(
    id="C2", title="Small model cut", step=2,
    measures="a 4-6 layer cut of the full model: operator-class coverage, per-layer shapes/dtypes, layer fidelity",
    pass_condition="the cut loads; its manifest covers every operator class of the full model; per-layer shapes "
                   "and dtypes equal the source layers'; each kept layer gives bitwise identical outputs to its "
                   "source layer on the same hidden states; with train.kernels consistent or vllm, the wrapped "
                   "model's forward equals the stock HF model's within rtol (float32 1e-4, bf16 5e-2) of each "
                   "module's output scale, at every decoder module and the logits (in bf16/fp16, where the whole "
                   "forward parts: each decoder layer on the stock model's input to it, the bound at least twice "
                   "the float32 stock model's distance there), and again with the model's "
                   "constant weights (norms at one, biases at zero) made uneven",
    inputs=["model.path (the full model)", "cut: out/layers/max_layers (optional; else cut into artifacts/C2/cut)"],
    artifacts=["artifacts/C2/check.json", "artifacts/C2/cut/ (when tic.yaml has no cut.out)"],
    guide="guides/C2.md", measure=measure, judge=judge, reads=("model", "cut"))
