"""Device probe: record the operators of one vLLM attention call (layer 0, a decode step) with tic's OpRecorder
and print what was recorded and what could not be.   python benchmarks/gpu/probe_record.py CONFIG.yaml"""

from __future__ import annotations

import sys

from tic.config.schema import load_config
from tic.harness.engines.base import Sampling
from tic.harness.locate.recorder import OpRecorder
from tic.skill.context import GateContext


def main() -> None:
    ctx = GateContext(load_config(sys.argv[1]))
    eng = ctx.live_rollout_engine("probe")
    attn = dict(eng.model().named_modules())["model.layers.0.self_attn.attn"]
    state = {"n": 0, "rec": None}

    def pre(m, a, k):
        state["n"] += 1
        if state["n"] == 3:  # a decode step
            state["rec"] = OpRecorder()
            state["rec"].__enter__()

    def post(m, a, k, o):
        if state["rec"] is not None:
            state["rec"].__exit__(None, None, None)
            print("calls:", [c.op for c in state["rec"].calls])
            print("errors:", state["rec"].errors)
            state["rec"] = None

    attn.register_forward_pre_hook(pre, with_kwargs=True)
    attn.register_forward_hook(post, with_kwargs=True)
    eng.generate_together([[1, 2, 3, 4], [5, 6, 7]], Sampling(temperature=1.0, max_tokens=4, seed=0), [0, 1])


if __name__ == "__main__":
    main()
