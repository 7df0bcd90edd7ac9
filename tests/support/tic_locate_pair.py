"""Two consistent-kernel HF engines over private copies of one model, and the locator run between them (decode
side A vs score side B on three seeded prompts): shared by the locator tests."""

from __future__ import annotations

import copy
from pathlib import Path

from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.engines.base import Sampling
from tic.harness.engines.hf import HFEngine
from tic.harness.locate import report
from tic.harness.locate.search import Side, locate
from tic.config.schema import load_config
from tic.skill.context import GateContext


def engines(config: Path) -> tuple[HFEngine, HFEngine]:
    """Private model copies: a plant on one side never leaks into the other or into the model cache."""
    ctx = GateContext(load_config(config))
    a = HFEngine(ctx.model.dir, "float32", kernels="consistent", batch_size=4, micro_batch_size=2)
    b = HFEngine(ctx.model.dir, "float32", kernels="consistent", batch_size=4, micro_batch_size=2)
    a.model = copy.deepcopy(a.model)
    b.model = copy.deepcopy(a.model)
    return a, b


def sides(a: HFEngine, b: HFEngine, upto: int = 2) -> tuple[Side, Side]:
    """Side A decodes the first of three seeded prompts' samples (a batch of them), side B scores it."""
    sp = Sampling(temperature=1.0, max_tokens=upto + 1, seed=0)
    prompts = [[5, 17, 99, 3, 250, 31], [7, 8, 9], [400, 2, 77, 13, 14]]
    samples = a.generate(prompts, sp, [0, 1, 2])
    ra, rb = HFCaptureRunner(a), HFCaptureRunner(b)
    return (Side("decode", ra, lambda spec: ra.decode(samples, 0, upto, spec)),
            Side("score", rb, lambda spec: rb.score(samples, 0, spec)))


def locate_pair(a: HFEngine, b: HFEngine, out: Path, upto: int = 2) -> dict:
    """The locator's record as written (locate.json, with the report's paths)."""
    return report.write(locate(*sides(a, b, upto), out, "plant", upto), out)
