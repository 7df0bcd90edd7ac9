"""The extension contract as a test (guides/extend.md): copy this file into your tests as test_<operator>.py,
set the four names below to your operator, and every test must pass before the ladder runs on the new model.

As shipped it checks an operator that follows the contract (Gemma's GELU-tanh gated MLP), and tic's own suite
runs it (tests/test_extend_template.py), so it cannot rot: each check fails when its part of the contract is
broken (the plants at the end prove it).
"""

import json
from pathlib import Path

import pytest
import torch

from tic.harness.engines.hf import load_model
from tic.harness.kernels import autograd as ag
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.coverage import REGISTRY, coverage_problems, coverage_table
from tic.harness.measure.fidelity import compare_forward, fidelity_inputs
from tic.harness.model.generate import generate_model
from tic.harness.model.layer_structure import build_meta

EXAMPLES = Path(__file__).resolve().parents[1]  # the examples folder (tiny model configs)

# ---- the four names to change -------------------------------------------------------------------------------
OP = "gelu_tanh_and_mul"              # the Op in autograd.OPS (forward: the provider's method of that name)
CLASS = "mlp:gelu_tanh_and_mul"       # the REGISTRY entry (coverage.py) the reader finds in a model using it
EXAMPLE = "tiny-gemma3"               # examples/<EXAMPLE>/config.json: a tiny model whose layers use it


def op_inputs(g: torch.Generator) -> tuple[tuple, dict]:
    """Inputs of one call of OP as the wrapper passes them (tensors, keywords): a batch of rows."""
    return (torch.randn(5, 3, 2 * 24, generator=g, dtype=torch.float32) * 3,), {}
# --------------------------------------------------------------------------------------------------------------


def _call(op: ag.Op, tensors, kw, provider=None):
    return ag.KernelFunction.apply(op, ag.Ops(provider or CPUProvider()), kw, *tensors)


def test_registry_entry_names_the_kernels_that_implement_it():
    assert CLASS in REGISTRY and REGISTRY[CLASS].kernels <= {"consistent", "vllm"} and REGISTRY[CLASS].kernels


def test_forward_is_the_providers_kernel_unchanged():
    """The wrapper returns exactly what the provider's kernel returns (the inference kernel defines the value)."""
    g = torch.Generator().manual_seed(0)
    tensors, kw = op_inputs(g)
    got = _call(ag.OPS[OP], tensors, kw)
    assert torch.equal(got, getattr(CPUProvider(), OP)(*tensors, **kw))


def test_cpu_kernel_gives_a_row_the_same_bits_alone_and_in_a_batch():
    """What C3 needs of a per-token operator: row i of a batch call equals the call on row i alone."""
    g = torch.Generator().manual_seed(1)
    tensors, kw = op_inputs(g)
    batch = getattr(CPUProvider(), OP)(*tensors, **kw)
    x = tensors[0]
    for i in range(x.shape[0]):
        alone = getattr(CPUProvider(), OP)(x[i:i + 1], *tensors[1:], **kw)
        assert torch.equal(batch[i:i + 1], alone)


def test_backward_is_the_gradient_of_the_float32_reference():
    """The written-out backward (or autograd through the reference, where the Op has none) against autograd
    through OP's reference, in float64 so only the formula is compared."""
    g = torch.Generator().manual_seed(2)
    tensors, kw = op_inputs(g)
    tensors = tuple(t.double().requires_grad_() for t in tensors)
    refs = tuple(t.detach().clone().requires_grad_() for t in tensors)
    out = _call(ag.OPS[OP], tensors, kw)
    seed = torch.randn(out.shape, generator=g, dtype=out.dtype)
    out.backward(seed)
    ag.OPS[OP].reference(*refs, **kw).backward(seed)
    for a, b in zip(tensors, refs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_the_reader_finds_it_and_every_layer_is_covered():
    cfg = json.loads((EXAMPLES / EXAMPLE / "config.json").read_text())
    meta = build_meta(cfg)
    rows = coverage_table(meta)
    assert any(CLASS in r["operator_classes"] for r in rows)
    assert coverage_problems(meta, "consistent") == []


@pytest.fixture(scope="module")
def models():
    d = generate_model(EXAMPLES / EXAMPLE, 0)  # cached by content under TIC_CACHE (the test session's)
    return (load_model(d, "float32", "stock", attn="eager", shared=False),
            load_model(d, "float32", "consistent", shared=False))


def test_the_wrapped_model_computes_the_stock_model(models):
    """C2's fidelity check: the wrapped forward equals stock HF's within the float32 bound at every module."""
    stock, wrapped = models
    ids, mask = fidelity_inputs(stock.config.get_text_config().vocab_size, "cpu")
    assert compare_forward(stock, wrapped, ids, mask)["first_parting"] is None


# ---- plants: each check above fails when its part of the contract is broken ---------------------------------
def test_plant_a_wrong_forward_fails_fidelity(models, monkeypatch):
    stock, wrapped = models
    provider = wrapped._tic_ops.provider
    monkeypatch.setattr(provider, OP, lambda *a, **k: getattr(CPUProvider(), OP)(*a, **k) * 1.01, raising=False)
    ids, mask = fidelity_inputs(stock.config.get_text_config().vocab_size, "cpu")
    assert compare_forward(stock, wrapped, ids, mask)["first_parting"] is not None


def test_plant_a_wrong_backward_fails_the_gradient_check(monkeypatch):
    op = ag.OPS[OP]
    def scaled(*a):  # the Op's gradient (written out, or through its reference) times 1.5
        grads = (op.backward(*a) if op.backward else None) or ag._reference_grads(op, *a[:5])
        return tuple(None if t is None else t * 1.5 for t in grads)

    wrong = ag.Op(op.name, op.kernel, op.reference, scaled)
    monkeypatch.setitem(ag.OPS, OP, wrong)
    with pytest.raises(AssertionError):
        test_backward_is_the_gradient_of_the_float32_reference()
