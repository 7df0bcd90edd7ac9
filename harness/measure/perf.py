"""Rollout throughput on a fixed workload (C1 baseline, C10 paired comparison).

A workload is `requests` prompts of `input_len` random tokens, each generating `output_len` tokens, submitted
`concurrency` at a time (one engine batch per wave). Each pass keeps one raw record per request; throughput is
generated tokens over the pass's wall time.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

from tic.config.schema import EngineConfig, PerfConfig, TicConfig
from tic.core.env import env_overlay
from tic.core.errors import TicInputError
from tic.harness.engines import engine_class
from tic.harness.engines.base import Engine, Sampling
from tic.harness.measure.fingerprint import environment_fingerprint


# The clock every pass is timed with; tests replace it with a deterministic one (a timed test on a shared
# machine measures its neighbours).
CLOCK = time.perf_counter


@dataclass(frozen=True)
class Workload:
    requests: int
    input_len: int
    output_len: int
    concurrency: int
    seed: int = 0
    temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg: TicConfig) -> "Workload":
        """perf:'s workload, sampled at sampling.temperature."""
        p = cfg.perf
        return cls(p.requests, p.input_len, p.output_len, p.concurrency, p.seed, cfg.sampling.temperature)

    def as_dict(self) -> dict:
        return asdict(self)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab_size) for _ in range(self.input_len)] for _ in range(self.requests)]


def side_config(rollout: EngineConfig, perf: PerfConfig, which: str) -> tuple[EngineConfig, dict[str, str]]:
    """('baseline' | 'consistent') -> (its rollout config, the env vars it runs under). Both sides take what the
    engine needs of either (its perf_changes); the baseline is the rollout with perf.baseline's changes
    (default: the engine's consistency switch off)."""
    if rollout.engine == "dump":
        raise TicInputError("C1/C10 measure a live rollout engine, not a dump")
    common = engine_class(rollout).perf_changes(rollout)
    r = EngineConfig.model_validate({**rollout.model_dump(), **common}) if common else rollout
    if which == "consistent":
        return r, dict(perf.consistent_env)
    changes = perf.baseline
    if changes is None:
        changes = engine_class(r).baseline_changes(r)  # from r, which holds what both sides need
    elif "options" in common and "options" in changes:  # a user's options keep what both sides need
        changes = {**changes, "options": {**common["options"], **changes["options"]}}
    try:
        return EngineConfig.model_validate({**r.model_dump(), **changes}), dict(perf.baseline_env)
    except ValueError as e:
        raise TicInputError(f"perf.baseline: {str(e).splitlines()[0]}") from None


def run_pass(engine: Engine, workload: Workload, vocab_size: int, label: str, repeat: int) -> dict:
    """One measured pass over the workload: per-request raw records and the pass's throughput."""
    prompts = workload.prompts(vocab_size)
    sampling = Sampling(workload.temperature, workload.output_len, workload.seed)
    records = []
    t_start = CLOCK()
    for w, i in enumerate(range(0, len(prompts), workload.concurrency)):
        wave = prompts[i:i + workload.concurrency]
        ids = list(range(i, i + len(wave)))
        t0 = CLOCK()
        out = engine.generate_together(wave, sampling, ids)
        t1 = CLOCK()
        if len(out) != len(wave):
            raise TicInputError(f"{label}: the engine returned {len(out)} outputs for {len(wave)} requests")
        for rid, s in zip(ids, out):
            records.append({"side": label, "repeat": repeat, "request": rid, "wave": w,
                            "input_tokens": len(s.prompt_ids), "output_tokens": len(s.response_ids),
                            "start_s": round(t0 - t_start, 6), "end_s": round(t1 - t_start, 6),
                            "latency_s": round(t1 - t0, 6)})
    wall = CLOCK() - t_start
    tokens = sum(r["output_tokens"] for r in records)
    return {"side": label, "repeat": repeat, "wall_s": wall, "output_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall > 0 else 0.0, "requests": records}


def spread(values: list[float]) -> dict:
    """Median, min, max and interquartile range of a list of measurements."""
    v = sorted(values)
    if not v:
        return {"n": 0}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"n": len(v), "median": statistics.median(v), "min": v[0], "max": v[-1], "q1": q[0], "q3": q[2],
            "iqr": q[2] - q[0]}


def side_fingerprint(engine: Engine, env: dict[str, str], workload: Workload, model_hash: str) -> dict:
    """Everything a rollout's speed and numerics depend on: environment (with this side's env vars), engine
    settings, model and workload."""
    own = engine.process_environment()
    environment = environment_fingerprint({**own.get("env", {}), **env})
    if "patches" in own:
        environment["patches"] = sorted(own["patches"])
    return {"environment": environment, "engine": engine.fingerprint(), "model": model_hash,
            "workload": workload.as_dict()}


def switch_allowance(engine: Engine) -> set[str]:
    """The fingerprint keys that may differ between baseline and consistent rollout: the consistency switch."""
    allowed = {f"engine.{k}" for k in engine.switch_keys} | {f"environment.env.{k}" for k in engine.switch_env}
    if "patches" in engine.switch_keys:  # the patches active in the process follow the engine's own list
        allowed.add("environment.patches")
    return allowed


def measure_sides(sides: dict[str, tuple[Engine, dict[str, str]]], workload: Workload, vocab_size: int,
                  warmup: int, repeats: int) -> list[dict]:
    """Warm each side up, then `repeats` rounds, each side once per round, the order alternating between
    rounds (ABBA...), so drift on the machine falls on both sides alike."""
    labels = list(sides)
    for label in labels:
        engine, env = sides[label]
        with env_overlay(env):
            for _ in range(warmup):
                run_pass(engine, workload, vocab_size, label, -1)
    passes = []
    for r in range(repeats):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            engine, env = sides[label]
            with env_overlay(env):
                passes.append(run_pass(engine, workload, vocab_size, label, r))
    return passes


def pass_summary(p: dict) -> dict:
    return {k: p[k] for k in ("side", "repeat", "wall_s", "output_tokens", "throughput_tok_s")}
