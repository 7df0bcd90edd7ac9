"""A stand-in for tic's VLLMEngine inside vLLM rank processes (CPU tests of tic.harness.engines.vllm_ranks).

Like vLLM's offline SPMD data parallel, the ranks of one DP group step together: every generate or score call
joins a collective over a gloo group built from VLLM_DP_MASTER_PORT, so ranks whose call sequences differ hang
(and the rank pool's timeout turns that into an error). A token's logprob depends on its request alone."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tic.harness.engines.base import Sample, Sampling, request_seed
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.locate import runners
from tic.harness.locate.capture import Capture


class StandInVLLM:
    kv_block_size, max_num_seqs, vllm_version, batch_invariant = 16, 256, "0.0-standin", False
    rollout_kernels = RolloutKernels(kv_block_size, "v2_sampler")

    def __init__(self, model_dir, dtype, options, batch_size, max_positions, vocab_size, patch_names=None,
                 tp=1, ep=1, dp=1, dcp=1):
        self.patches, self.dp, self.ep, self.calls = list(patch_names or []), dp, ep, 0
        self.env = {k: os.environ.get(k) for k in ("VLLM_DP_RANK", "VLLM_DP_SIZE", "CUDA_VISIBLE_DEVICES")}
        if dp > 1:
            assert os.environ["VLLM_DP_SIZE"] == str(dp)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['VLLM_DP_MASTER_PORT']}",
                                    rank=int(os.environ["VLLM_DP_RANK"]), world_size=dp,
                                    timeout=timedelta(seconds=20))

    @property
    def turns(self) -> int:
        return self.calls

    def _step(self) -> None:
        self.calls += 1
        if self.dp > 1:  # the lockstep: every rank joins every step
            dist.all_reduce(torch.ones(1))

    def generate_together(self, prompts, sampling, request_ids):
        self._step()
        out = []
        for p, rid in zip(prompts, request_ids):
            g = torch.Generator().manual_seed(request_seed(sampling.seed, rid) % (1 << 62))
            resp = torch.randint(0, 50, (sampling.max_tokens,), generator=g).tolist()
            lp = -torch.rand(sampling.max_tokens, generator=g) - 0.001 * sum(p)
            out.append(Sample(prompt_ids=list(p), response_ids=resp, logprobs=lp, id=rid))
        return out

    def score(self, samples, sampling):
        self._step()
        return [torch.full((len(s.response_ids),), -0.5 - 0.001 * sum(s.prompt_ids)) for s in samples]

    def take_turn(self):
        self._step()

    def fingerprint(self):
        return {"engine": "vllm-standin", "env": self.env, "calls": self.calls}

    def process_environment(self):
        return {}


class RefusingVLLM(StandInVLLM):
    """Refuses its configuration as VLLMEngine does (TicInputError)."""

    def __init__(self, *a, **kw):
        from tic.core.errors import TicInputError

        raise TicInputError(f"vocab_size {kw.get('vocab_size')!r} is not a vocabulary size")


class StandInCaptureRunner:
    """Reruns the compared request in two engine calls (two lockstep turns), as a capture with a replay would."""

    modules = {"model": None, "model.layers.0": None}
    repro_setup = ["import os"]

    def __init__(self, engine, temperature):
        self.engine, self.temperature = engine, temperature

    def stages(self):
        return ["model.layers.0"]

    def children(self, name):
        return []

    def decode(self, samples, target, upto, spec, together=False):
        if spec == "fail":
            raise RuntimeError("capture hook failed: planted")
        s = samples[target]
        for _ in range(2):
            self.engine.generate_together([s.prompt_ids], Sampling(max_tokens=1), [s.id])
        cap = Capture()
        cap.logprobs = {0: torch.tensor(float(self.engine.calls))}
        cap.owner = {"prompt": list(s.prompt_ids), "index": target, "share": [x.id for x in samples]}
        return cap

    def score(self, samples, target, spec):
        return self.decode(samples, target, 0, spec)


runners.register(StandInVLLM, StandInCaptureRunner)  # the locator's runner for the stand-in, in every rank


class CheckingVLLM(StandInVLLM):
    """Checks its prompts' token ids before it steps, as VLLMEngine does (TicInputError): with SPMD ranks, the
    other ranks step on and wait in the collective for the rank that refused."""

    def generate_together(self, prompts, sampling, request_ids):
        from tic.core.errors import TicInputError

        for p in prompts:
            if max(p) >= 50:
                raise TicInputError(f"token id outside the vocabulary (size 50): {p}")
        return super().generate_together(prompts, sampling, request_ids)


def rank_env(state: dict) -> dict:
    """The variables the rank's engine saw when it started (a RankPool call)."""
    return state["engine"].env
