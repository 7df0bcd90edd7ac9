"""C9: checkpoint restore and stepwise scale-up. A training checkpoint (weights + optimizer state) saved after
one update is restored in a fresh process; its first step must reproduce the uninterrupted run bit for bit
(same samples, diff = 0, identical update). Then C5 is re-run at each scale_up stage (more layers, longer
context, the full model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tic.config.schema import ScaleStage, TicConfig
from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_text
from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.gates.c5 import measure as measure_c5
from tic.harness.model.generate import has_weights, read_model_config
from tic.harness.measure.metrics import is_exact_match, summary
from tic.harness.measure.rl import (PolicyGradientTrainer, equal_tensors, rollout_and_recompute, samples_as_tensors,
                                    sync_weights, with_rl_engines)


def _restore(ctx) -> tuple[dict | None, str | None]:
    """(the restore's record, None) on the gate's own engines; (None, why) when the rollout engine cannot sync."""
    return with_rl_engines(ctx.private_engine("rollout", "C9"), ctx.private_engine("train", "C9"),
                           lambda rollout, train: _restore_with(ctx, rollout, train))


def _restore_with(ctx, rollout, train) -> dict:
    t = ctx.cfg.training
    out = ctx.artifacts("C9")
    ckpt, fresh = out / "checkpoint", out / "restored"
    for d in (ckpt, fresh):
        shutil.rmtree(d, ignore_errors=True)
    trainer = PolicyGradientTrainer(train, t.lr, 1)
    samples, _, m0 = rollout_and_recompute(rollout, train, ctx.prompts, ctx.sampling, 0)
    if not is_exact_match(m0):  # restoring a run that is not diff = 0 proves nothing; C5/C8 first
        return {"before_checkpoint_exact": False, "uninterrupted_exact": False, "restored_exact": False,
                "restored_diff": "", "restored_sync_ok": False, "restored_optimizer_updates": 0, "restore": {},
                "rollout_differs": [], "update_differs": [], "checkpoint": "", "first_diff": summary(m0)}
    trainer.step(samples, ctx.sampling)
    sync_weights(trainer, rollout)
    trainer.save(ckpt)
    # the uninterrupted run's next step: the reference the restored process must reproduce
    samples, recompute, m1 = rollout_and_recompute(rollout, train, ctx.prompts, ctx.sampling, trainer.version)
    trainer.step(samples, ctx.sampling)
    reference_rollout = samples_as_tensors(samples, recompute)
    reference_update = {k: v.detach().clone() for k, v in trainer.weights().items()}

    fresh.mkdir(parents=True, exist_ok=True)
    res = restore_in_fresh_process(ctx.cfg, ckpt, fresh)
    rollout_diff = equal_tensors(reference_rollout, load_file(str(fresh / "rollout.safetensors")))
    update_diff = equal_tensors(reference_update, load_file(str(fresh / "updated.safetensors")))
    return {"before_checkpoint_exact": is_exact_match(m0), "uninterrupted_exact": is_exact_match(m1),
            "restored_exact": is_exact_match(res["diff"]), "restored_diff": summary(res["diff"]),
            "restored_sync_ok": res["sync_ok"], "restored_optimizer_updates": res["optimizer_updates"],
            "restore": res["restore"], "rollout_differs": rollout_diff, "update_differs": update_diff,
            "checkpoint": str(ckpt)}


def restore_in_fresh_process(cfg: TicConfig, checkpoint: Path, out_dir: Path, timeout_s: float = 1800) -> dict:
    """Run the first step after restoring `checkpoint` in a new Python process (tic.skill.rl_worker) with this
    config; returns its result.json (its tensors stay in out_dir)."""
    job = out_dir / "job.json"
    atomic_write_text(job, json.dumps({"config": cfg.model_dump(mode="json"),
                                       "base_dir": str(Path(cfg.base_dir).resolve()),
                                       "checkpoint": str(checkpoint.resolve()), "out": str(out_dir.resolve())}))
    r = subprocess.run([sys.executable, "-m", "tic.skill.rl_worker", str(job)], capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode == 2:
        raise TicInputError(r.stderr.strip().splitlines()[-1].removeprefix("tic: error: "))
    if r.returncode != 0 or not (out_dir / "result.json").is_file():
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"restore process exited {r.returncode}: {tail}")
    return json.loads((out_dir / "result.json").read_text())


def stage_config(ctx, stage: ScaleStage, index: int) -> TicConfig:
    """The config of one scale-up stage: another model directory and/or config.json changes (generated weights),
    longer prompts, more generated tokens."""
    cfg = ctx.cfg.model_copy(deep=True)
    cfg.base_dir = ctx.cfg.base_dir
    if cfg.model is None:
        raise TicInputError("scale_up needs a model")
    src = ctx.cfg.resolve(stage.model_path) if stage.model_path is not None else ctx.model_source_dir
    if stage.config:
        if has_weights(src) or cfg.model.generate is None:
            raise TicInputError(f"scale_up stage {index}: config changes need generated weights (model.generate "
                                "and no *.safetensors); point model_path at the larger model instead")
        d = (ctx.artifacts("C9") / f"stage-{index}").resolve()
        atomic_write_text(d / "config.json", json.dumps({**read_model_config(src), **stage.config}, indent=2))
        src = d
    cfg.model.path = Path(src).resolve()
    if stage.prompt_len is not None:
        cfg.prompts.min_len = min(cfg.prompts.min_len, stage.prompt_len)
        cfg.prompts.max_len = stage.prompt_len
    if stage.max_tokens is not None:
        cfg.sampling.max_tokens = stage.max_tokens
    return cfg


def measure(ctx) -> Measurement:
    r, why = _restore(ctx)
    if why:
        return Measurement(unavailable=why)
    stages = []
    for i, stage in enumerate(ctx.cfg.scale_up if r["before_checkpoint_exact"] else []):
        sub = ctx.with_config(stage_config(ctx, stage, i))
        m = measure_c5(sub).metrics
        stages.append({"stage": stage.name or f"stage {i}", "model": str(sub.model_source_dir),
                       "layers": sub.model_config.get("num_hidden_layers"), "prompt_len": sub.cfg.prompts.max_len,
                       "max_tokens": sub.cfg.sampling.max_tokens, "exact": is_exact_match(m), "diff": summary(m),
                       "first_mismatch": m["first_mismatch"]})
    path = ctx.artifacts("C9") / "result.json"
    atomic_write_text(path, json.dumps({"restore": r, "stages": stages}, indent=2, default=str))
    return Measurement(
        metrics={"restored_exact": r["restored_exact"], "update_identical": not r["update_differs"],
                 "rollout_identical": not r["rollout_differs"],
                 "uninterrupted_exact": r["before_checkpoint_exact"] and r["uninterrupted_exact"],
                 "restored_sync_ok": r["restored_sync_ok"],
                 "restored_optimizer_updates": r["restored_optimizer_updates"],
                 "stages": len(stages), "exact_stages": sum(s["exact"] for s in stages),
                 "stages_configured": len(ctx.cfg.scale_up)},
        details={"restore": r, "stages": stages},
        evidence=[str(path)] + ([r["checkpoint"]] if r["checkpoint"] else []),
    )


def judge(m: Measurement) -> Judgement:
    x, r = m.metrics, m.details["restore"]
    # the figure names only what ran: no restore verdict when the run before it already differs, no 0/0 stages
    restore = ("restore not compared (not diff = 0 before it)" if not x["uninterrupted_exact"] else
               f"restore {'identical' if x['update_identical'] and x['rollout_identical'] else 'DIFFERS'}")
    stages = (f"{x['exact_stages']}/{x['stages']} scale-up stages diff = 0" if x["stages"] else
              "scale-up not run" if x.get("stages_configured") else "no scale-up stage configured")
    key = f"{restore}, {stages}"
    if not x["uninterrupted_exact"]:
        return Judgement(Verdict.FAIL, f"the run before the checkpoint is not diff = 0 "
                                       f"({r.get('first_diff', '')}); pass C5 and C8 first", key)
    if not x["restored_sync_ok"]:
        return Judgement(Verdict.FAIL, "the restored process's weight sync moved or missed weights", key)
    if not x["restored_exact"]:
        return Judgement(Verdict.FAIL, f"first step after restore: train differs from rollout "
                                       f"({r['restored_diff']})", key)
    if not x["rollout_identical"]:
        return Judgement(Verdict.FAIL, f"first step after restore samples differently from the uninterrupted run "
                                       f"(e.g. {r['rollout_differs'][0]}): the restored weights are not the saved "
                                       "ones", key)
    if x["restored_optimizer_updates"] != 1 or not x["update_identical"]:
        return Judgement(Verdict.FAIL, f"first update after restore differs from the uninterrupted run in "
                                       f"{len(r['update_differs'])} tensor(s) "
                                       f"(e.g. {(r['update_differs'] or ['?'])[0]}); "
                                       f"optimizer state restored: {r['restore'].get('optimizer_state')}", key)
    if x["stages"] == 0:
        return Judgement(Verdict.FAIL, "restore is identical, but scale_up lists no stage: add the larger model / "
                                       "longer context stages C9 must re-run C5 on", key)
    if x["exact_stages"] < x["stages"]:
        s = next(s for s in m.details["stages"] if not s["exact"])
        return Judgement(Verdict.FAIL, f"scale-up stage {s['stage']!r} ({s['layers']} layers, prompts up to "
                                       f"{s['prompt_len']}): {s['diff']}", key)
    return Judgement(Verdict.PASS, "first step after a fresh-process restore reproduces the uninterrupted run bit for "
                                   "bit with diff = 0, and diff = 0 at every scale-up stage", key)


GATE = Gate(
    id="C9", title="Full model and checkpoint restore", step=4,
    measures="a checkpoint (weights + AdamW state) saved after one update and restored in a fresh process: its first "
             "step's samples, diff and updated weights vs the uninterrupted run's; then C5's diff at each scale_up "
             "stage (more layers, longer context, another model directory)",
    pass_condition="the uninterrupted and the restored step are diff = 0; the restored step samples the same tokens "
                   "with the same logprob bits and its update leaves every weight bitwise equal to the uninterrupted "
                   "run's (exactly 1 update); at least one scale_up stage, each diff = 0",
    inputs=["rollout engine (live, in-place weight sync)", "train engine (hf)", "training", "scale_up"],
    artifacts=["artifacts/C9/checkpoint/", "artifacts/C9/restored/", "artifacts/C9/result.json"],
    guide="guides/C9.md", measure=measure, judge=judge)
