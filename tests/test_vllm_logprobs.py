"""Logprobs on vLLM's kernels follow the rollout's runner: its V1 runner's sampler takes a float32 log_softmax, its
V2 runner's sampler (vLLM's pick for dense models) a Triton kernel of its own whose sum runs block by block. The
training side asks that kernel for each row's log-sum-exp and must then give, for every token, exactly what the
kernel gives. Checked on CPU with a stand-in for the kernel that sums in its own order, as the real one does."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tic.harness.kernels.spec import RolloutKernels

MODULE = "vllm.v1.worker.gpu.sample.logprob"


def blocked_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The V2 kernel's arithmetic per row: the max, exp-sums block by block (each block's sum in a pairwise order
    of its own), the log, then (logit - max) - lse at the asked tokens. Like the real kernel, whose compiled sum
    runs in another order for bf16 logits than for float32 ones, the order depends on the logits' dtype."""
    block = 1024 if logits.dtype == torch.bfloat16 else 768
    m = logits.float().amax(dim=-1, keepdim=True)
    e = torch.exp(logits.float() - m)
    se = torch.zeros_like(m)
    for i in range(0, logits.shape[-1], block):
        part = e[:, i:i + block]
        while part.shape[-1] > 1:  # a tree inside the block, unlike torch's own reduction
            if part.shape[-1] % 2:
                part = torch.cat([part, torch.zeros_like(part[:, :1])], dim=-1)
            part = part[:, 0::2] + part[:, 1::2]
        se = se + part
    picked = logits.float().gather(-1, token_ids)
    return (picked - m) - torch.log(se)


@pytest.fixture
def provider(monkeypatch):
    from tic.harness.kernels.vllm_provider import VLLMProvider

    mod = types.ModuleType(MODULE)
    mod.compute_token_logprobs = blocked_token_logprobs
    monkeypatch.setitem(sys.modules, MODULE, mod)
    monkeypatch.setattr(VLLMProvider, "_load_vllm", lambda self: None)
    return lambda rule: VLLMProvider(RolloutKernels(16, rule))


def _logits(rows: int = 24, vocab: int = 5003) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(rows, vocab, generator=g) * 4).bfloat16().float()


def test_every_token_equals_the_v2_kernels_own_value(provider):
    logits = _logits()
    V = logits.shape[-1]
    every = blocked_token_logprobs(logits, torch.arange(V).expand(logits.shape[0], V).contiguous())
    assert torch.equal(provider("v2_sampler").log_softmax(logits), every)
    three_d = provider("v2_sampler").log_softmax(logits.reshape(2, 12, V))
    assert three_d.shape == (2, 12, V) and torch.equal(three_d.reshape(-1, V), every)


def test_the_v1_rule_is_torchs_log_softmax_and_differs_from_the_v2_kernel(provider):
    """The plant: a training side that keeps the V1 rule against a V2 rollout differs in the last bits (as C5
    measured on the GPU, 1 ulp on some tokens), so the rule handed over is what makes them equal."""
    logits = _logits()
    v1 = provider("log_softmax").log_softmax(logits)
    assert torch.equal(v1, torch.log_softmax(logits, dim=-1))
    assert not torch.equal(v1, provider("v2_sampler").log_softmax(logits))


def test_an_unknown_logprob_rule_is_refused():
    with pytest.raises(ValueError, match="logprob rule"):
        RolloutKernels(16, "softmax")


def test_the_kernel_gets_the_logits_in_the_models_dtype(provider):
    """bf16 logits reach the kernel as bf16, the dtype vLLM's sampler hands it: the same values widened to float32
    would take the kernel's float32 order and differ on some tokens."""
    logits = _logits().bfloat16()
    V = logits.shape[-1]
    every = blocked_token_logprobs(logits, torch.arange(V).expand(logits.shape[0], V).contiguous())
    assert torch.equal(provider("v2_sampler").log_softmax(logits), every)
    assert not torch.equal(provider("v2_sampler").log_softmax(logits.float()), every)


def test_the_training_engine_hands_its_provider_the_models_logits(tiny_bf16_engine):
    engine, seen = tiny_bf16_engine
    logits = torch.randn(5, engine.vocab_size).bfloat16()
    lp = engine.logprobs_of(logits, 1.0)
    assert seen == [torch.bfloat16] and lp.dtype == torch.float32
    engine.logprobs_of(logits, 0.7)  # a temperature divides in float32 first
    assert seen[-1] == torch.float32


@pytest.fixture
def tiny_bf16_engine(monkeypatch):
    from tic.harness.engines.hf import HFEngine
    from tic.harness.kernels.consistent_cpu import CPUProvider
    from tic.harness.testing.tinymodels import tiny_model

    seen = []
    real = CPUProvider.log_softmax
    monkeypatch.setattr(CPUProvider, "log_softmax", lambda self, x: seen.append(x.dtype) or real(self, x))
    engine = HFEngine(tiny_model(5, "qwen3")[0], "bfloat16", kernels="consistent", shared_model=False)
    return engine, seen


def test_each_engine_keeps_the_runner_vllm_started_it_with(monkeypatch):
    """vLLM decides the runner from the environment at the engine's start (VLLM_USE_V2_MODEL_RUNNER, else by model):
    what it decided is kept per engine then, not read again later, when another engine may have changed it."""
    from types import SimpleNamespace

    from tic.harness.engines import vllm as vllm_engine

    class LLM:
        def __init__(self, **kwargs):
            runner = SimpleNamespace(use_v2_model_runner=kwargs["model"] == "dense")
            self.llm_engine = SimpleNamespace(vllm_config=runner)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(vllm_engine, "_LLMS", {})
    monkeypatch.setattr(vllm_engine, "_V2_RUNNER", {})
    vllm_engine._start_llm("dense engine", {"model": "dense"}, [], False, False)
    vllm_engine._start_llm("moe engine", {"model": "moe"}, [], False, False)
    assert vllm_engine._V2_RUNNER == {"dense engine": True, "moe engine": False}
