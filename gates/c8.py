"""C8: two RL updates with weight sync. Rollout -> recompute (diff = 0) -> one policy-gradient update ->
weights copied into the rollout engine in place -> rollout -> recompute under the new weight version
(diff = 0 again), for `training.updates` consecutive updates, on engines whose models no other gate shares."""

from __future__ import annotations

import json

from tic.gates.base import Gate, Judgement, Measurement, Verdict
from tic.core.fsio import atomic_write_text
from tic.harness.measure.metrics import is_exact_match, summary
from tic.harness.measure.rl import PolicyGradientTrainer, rollout_and_recompute, sync_weights, with_rl_engines


def _row(version: int, samples, m: dict) -> dict:
    return {"version": version, "exact": is_exact_match(m), "diff": summary(m), "max": m["max"],
            "equal_fraction": m["equal_fraction"], "first_mismatch": m["first_mismatch"],
            "sample_versions": sorted({s.weight_version for s in samples}, key=str)}


def measure(ctx) -> Measurement:
    res, why = with_rl_engines(ctx.private_engine("rollout", "C8"), ctx.private_engine("train", "C8"),
                               lambda rollout, train: _updates(ctx, rollout, train))
    return Measurement(unavailable=why) if why else res


def _updates(ctx, rollout, train) -> Measurement:
    t = ctx.cfg.training
    trainer = PolicyGradientTrainer(train, t.lr, t.updates_per_step)
    start_equal = not rollout.unequal_weights(trainer.weights_for(rollout))
    samples, _, m = rollout_and_recompute(rollout, train, ctx.prompts, ctx.sampling, 0)
    rows = [_row(0, samples, m)]
    updates, syncs = [], []
    for _ in range(t.updates if rows[0]["exact"] else 0):  # not diff = 0 before any update: C5 first
        count = trainer.optimizer_steps  # counted around the whole RL step: a retried or extra update shows
        rep = trainer.step(samples, ctx.sampling)
        sync = sync_weights(trainer, rollout)
        updates.append({"version": rep.version, "optimizer_updates": trainer.optimizer_steps - count,
                        "loss": rep.loss,
                        "reward_mean": rep.reward_mean, "changed_tensors": rep.changed_tensors})
        syncs.append({"version": sync.version, "storage_moved": sync.storage_moved, "unequal": sync.unequal,
                      "refreshed": sync.details.get("refreshed", [])})
        samples, _, m = rollout_and_recompute(rollout, train, ctx.prompts, ctx.sampling, trainer.version)
        rows.append(_row(trainer.version, samples, m))
        if not rows[-1]["exact"]:
            break  # the first weight version that differs is the finding; later ones add nothing
    path = ctx.artifacts("C8") / "steps.json"
    atomic_write_text(path, json.dumps({"compares": rows, "updates": updates, "syncs": syncs}, indent=2,
                                       default=str))
    return Measurement(
        metrics={"updates": len(updates), "updates_required": 2, "updates_per_step": t.updates_per_step,
                 "versions_compared": len(rows), "exact_versions": sum(r["exact"] for r in rows),
                 "max_diff": max(r["max"] for r in rows),
                 "optimizer_updates_per_step": [u["optimizer_updates"] for u in updates],
                 "unchanged_updates": sum(u["changed_tensors"] == 0 for u in updates),
                 "storage_moved": sum(len(s["storage_moved"]) for s in syncs),
                 "unequal_after_sync": sum(len(s["unequal"]) for s in syncs),
                 "start_weights_equal": start_equal,
                 "stale_samples": sum(r["sample_versions"] != [r["version"]] for r in rows)},
        details={"compares": rows, "updates": updates, "syncs": syncs,
                 "rollout": rollout.fingerprint(), "train": train.fingerprint()},
        evidence=[str(path)],
    )


def judge(m: Measurement) -> Judgement:
    x = m.metrics
    key = (f"{x['exact_versions']}/{x['versions_compared']} weight versions diff = 0 over {x['updates']} updates, "
           f"{x['storage_moved']} weights moved")
    if x["updates_per_step"] != 1 or any(n != 1 for n in x["optimizer_updates_per_step"]):
        return Judgement(Verdict.FAIL, f"exactly 1 optimizer update per RL step is required; counted "
                                       f"{x['optimizer_updates_per_step']} (training.updates_per_step = "
                                       f"{x['updates_per_step']}): later mini-batches train on weights the rollout "
                                       "did not sample from", key)
    if x["exact_versions"] < x["versions_compared"] and x["updates"] < x["updates_required"]:
        r = next(r for r in m.details["compares"] if not r["exact"])
        return Judgement(Verdict.FAIL, f"weight version {r['version']}: train differs from rollout ({r['diff']}); "
                                       "stopped there", key)
    if x["updates"] < x["updates_required"]:
        return Judgement(Verdict.FAIL, f"{x['updates']} update(s) run; C8 needs {x['updates_required']} consecutive "
                                       "updates (training.updates)", key)
    if not x["start_weights_equal"]:
        return Judgement(Verdict.FAIL, "rollout and train engines start from different weights", key)
    if x["unchanged_updates"]:
        return Judgement(Verdict.FAIL, f"{x['unchanged_updates']} update(s) changed no weight: the comparison after "
                                       "them proves nothing", key)
    if x["storage_moved"]:
        moved = next(s["storage_moved"] for s in m.details["syncs"] if s["storage_moved"])
        return Judgement(Verdict.FAIL, f"weight sync re-allocated {x['storage_moved']} weight(s) instead of copying in "
                                       f"place (e.g. {moved[0]}): graphs captured on the old addresses would keep "
                                       "the old weights", key)
    if x["unequal_after_sync"]:
        bad = next(s["unequal"] for s in m.details["syncs"] if s["unequal"])
        return Judgement(Verdict.FAIL, f"after weight sync {x['unequal_after_sync']} rollout weight(s) differ from the "
                                       f"trainer's (e.g. {bad[0]})", key)
    if x["stale_samples"]:
        return Judgement(Verdict.FAIL, "a rollout was sampled under a weight version other than the trainer's", key)
    if x["exact_versions"] == x["versions_compared"]:
        return Judgement(Verdict.PASS, "diff = 0 before the first update and after each in-place weight sync", key)
    r = next(r for r in m.details["compares"] if not r["exact"])
    f = r["first_mismatch"] or {}
    return Judgement(Verdict.FAIL, f"weight version {r['version']}: train differs from rollout ({r['diff']}); first at "
                                   f"sequence {f.get('sequence')}, position {f.get('position')}", key)


GATE = Gate(
    id="C8", title="Two RL updates with weight sync", step=4,
    measures="C5's diff at weight version 0 and after each of training.updates policy-gradient updates (synthetic "
             "reward, AdamW), each followed by an in-place weight sync into the rollout engine; optimizer updates "
             "per step (counted), weight storage before/after sync, rollout weights vs trainer weights",
    pass_condition="exactly 1 optimizer update per step, at least 2 updates each changing the weights, every sync "
                   "copies in place (every weight's data pointer, shape and dtype unchanged) and leaves the rollout "
                   "weights bitwise equal to the trainer's, and diff = 0 (bitwise) at every weight version",
    inputs=["rollout engine (live, in-place weight sync)", "train engine (hf)", "prompts", "sampling", "training"],
    artifacts=["artifacts/C8/steps.json"], guide="guides/C8.md", measure=measure, judge=judge)
