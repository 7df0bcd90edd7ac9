"""Device probe: record the operators of one vLLM attention call (layer 0) with tic's OpRecorder and print
what was recorded and what could not be.   python probe_record.py CONFIG.yaml"""

import sys

from tic.harness.locate.recorder import OpRecorder
from tic.config.schema import load_config
from tic.skill.context import GateContext

ctx = GateContext(load_config(sys.argv[1]))
eng = ctx.live_rollout_engine("probe")
model = eng.model()
attn = dict(model.named_modules())["model.layers.0.self_attn.attn"]
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


h1 = attn.register_forward_pre_hook(pre, with_kwargs=True)
h2 = attn.register_forward_hook(post, with_kwargs=True)
from tic.harness.engines.base import Sampling  # noqa: E402

eng.generate_together([[1, 2, 3, 4], [5, 6, 7]], Sampling(temperature=1.0, max_tokens=4, seed=0), [0, 1])
