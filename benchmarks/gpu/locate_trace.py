"""Run C5 of CONFIG, then the locator on its failure with the whole traceback on an error (a locator error is
otherwise one line in the gate record).   python benchmarks/gpu/locate_trace.py CONFIG.yaml OUT.json [--plant-eps N]

--plant-eps N first sets the eps of layer N's post-attention norm on the train side to 1e-3 (the module found by
its HF name through the train engine's capture runner, so the same plant works on the hf and megatron engines; an
hf train side on CPU shares its model with an hf rollout, so plant against a vLLM rollout or a megatron trainer):
C5 must then fail and the locator name model.layers.N.post_attention_layernorm, with a repro that exits 1."""

from __future__ import annotations

import json
import traceback
from pathlib import Path


def _short(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)}:{v.dtype}:{v.device}:stride{v.stride()}"
    if isinstance(v, (list, tuple)):
        return type(v).__name__ + "[" + ", ".join(_short(x) for x in list(v)[:8]) + ("..." if len(v) > 8 else "") + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in list(v.items())[:12]) + "}"
    return repr(v)[:200]


def plant_eps(ctx, layer: int) -> None:
    from tic.harness.locate.runners import runner_for

    norm = runner_for(ctx.train_engine(), 1.0).modules[f"model.layers.{layer}.post_attention_layernorm"]
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", 1e-3)


def main() -> None:
    import argparse

    from tic.gates import get
    from tic.harness.locate.search import locate_for_gate
    from tic.config.schema import load_config
    from tic.skill.context import GateContext

    ap = argparse.ArgumentParser()
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--plant-eps", type=int, default=None, metavar="N")
    args = ap.parse_args()
    ctx = GateContext(load_config(args.config))
    if args.plant_eps is not None:
        plant_eps(ctx, args.plant_eps)
    gate = get("C5")
    measured = gate.measure(ctx)
    print("C5", gate.judge(measured).verdict, measured.metrics.get("first_mismatch"), flush=True)
    try:
        found = locate_for_gate(ctx, "C5", measured, strict=True)
        out = {"ok": True, "found": found}
    except Exception as e:  # noqa: BLE001  the point of this script: show where
        tb = e.__traceback__
        frames = []
        while tb is not None:
            f = tb.tb_frame
            frames.append({"where": f"{f.f_code.co_filename}:{tb.tb_lineno} {f.f_code.co_name}",
                           "locals": {k: _short(v) for k, v in list(f.f_locals.items())[:20]}})
            tb = tb.tb_next
        traceback.print_exc()
        for fr in frames[-6:]:
            print("FRAME", fr["where"])
            for k, v in fr["locals"].items():
                print("   ", k, "=", v)
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "frames": frames}
    args.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
