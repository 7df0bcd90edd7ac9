"""The vLLM provider's plumbing on CPU, vLLM's kernels stood in (the GPU run validates the kernels): the rotary
kernel's pairing style; block FP8, where the linear runs vLLM's Fp8LinearMethod on a layer prepared once per copy, the experts get vLLM's FP8 block quant
config, and with an FP8 KV cache K/V go through reshape_and_cache_flash into FP8 pages read by the same
varlen FlashAttention call."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tic.harness.kernels import autograd as ag
from tic.harness.kernels.consistent_cpu import CPUProvider
from tic.harness.kernels.fp8 import QuantizedCopies
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.model.quantize import quantize_weight_blocks


def _cpu_vllm_provider(monkeypatch, kv_cache_dtype="auto", block=16):
    from tic.harness.kernels.vllm_provider import VLLMProvider

    monkeypatch.setattr(VLLMProvider, "_load_vllm", lambda self: None)
    return VLLMProvider(RolloutKernels(block), kv_cache_dtype)


def _modules(monkeypatch, **mods):
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.fused_moe"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)


@pytest.fixture
def fp8_method_calls(monkeypatch):
    """vLLM's Fp8LinearMethod, its config context and default dtype stood in; the list of their calls."""
    import contextlib

    calls = []

    class Fp8LinearMethod:
        def __init__(self, quant_config):
            calls.append(("method", quant_config, CURRENT[-1]))

        def create_weights(self, layer, K, partitions, k, n, dtype, weight_loader=None):
            calls.append(("create", K, partitions, dtype, torch.get_default_dtype()))
            layer.weight = torch.nn.Parameter(torch.empty(sum(partitions), K, dtype=torch.float8_e4m3fn),
                                              requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(torch.empty(sum(partitions) // 16, K // 16),
                                                        requires_grad=False)

        def process_weights_after_loading(self, layer):
            calls.append(("prepare", CURRENT[-1]))

        def apply(self, layer, x, bias=None):
            calls.append(("apply", CURRENT[-1]))
            return x @ (layer.weight.float() * layer.weight_scale_inv.repeat_interleave(16, 0)
                        .repeat_interleave(16, 1)).t()

    CURRENT = [None]

    @contextlib.contextmanager
    def set_current_vllm_config(cfg):
        CURRENT.append(cfg)
        yield
        CURRENT.pop()

    @contextlib.contextmanager
    def set_default_torch_dtype(dtype):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        yield
        torch.set_default_dtype(old)

    class VllmConfig:
        def __init__(self, model_config):
            self.model_config, self.quant_config = model_config, ("quant config of", model_config["model"])

    _modules(monkeypatch, **{"vllm.model_executor.layers.quantization.fp8": dict(Fp8LinearMethod=Fp8LinearMethod),
                             "vllm.config": dict(VllmConfig=VllmConfig, set_current_vllm_config=set_current_vllm_config,
                                                 ModelConfig=lambda **kw: kw),
                             "vllm.utils.torch_utils": dict(set_default_torch_dtype=set_default_torch_dtype)})
    return calls


def test_linear_runs_vllms_fp8_linear_method_on_a_layer_made_once_per_copy(monkeypatch, tmp_path, fp8_method_calls):
    """Under the rollout's config for the checkpoint: the method from its quant config, create_weights for the
    copy's shape (vLLM selects the GEMM kernel there), the copy in the layer, prepared once, applied per call."""
    calls = fp8_method_calls
    prov = _cpu_vllm_provider(monkeypatch)
    w = torch.nn.Parameter(torch.randn(32, 16, dtype=torch.float64) * 0.1)
    quant = QuantizedCopies((16, 16), tmp_path)
    quant.register("w", w)
    x = torch.randn(3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="checkpoint"):
        prov.fp8_linear(x, *quant.get(w), None, (16, 16))
    outs = [prov.fp8_linear(x, *quant.get(w), None, (16, 16), checkpoint=tmp_path) for _ in range(2)]
    cfg = calls[0][2]
    assert cfg.model_config == dict(model=str(tmp_path), dtype=torch.float64, enforce_eager=True,
                                    skip_tokenizer_init=True)
    assert calls == [("method", ("quant config of", str(tmp_path)), cfg),
                     ("create", 16, [32], torch.float64, torch.float64), ("prepare", cfg), ("apply", cfg),
                     ("apply", cfg)]
    codes, scales = quant.get(w)
    want = x @ (codes.float() * scales.repeat_interleave(16, 0).repeat_interleave(16, 1)).t().double()
    assert torch.equal(outs[0], outs[1]) and torch.allclose(outs[0], want)  # the copy is what the layer holds
    with torch.no_grad():
        w.mul_(2)  # an update: the copy is requantized in place, the layer made again
    prov.fp8_linear(x, *quant.get(w), None, (16, 16), checkpoint=tmp_path)
    assert [c[0] for c in calls[5:]] == ["method", "create", "prepare", "apply"]


def test_a_first_call_inside_inference_mode_leaves_copies_the_training_forward_can_use(monkeypatch, tmp_path,
                                                                                      fp8_method_calls):
    """C5 scores under inference mode and may be the first forward of a run: the joined copy of q/k/v-like
    weights and the prepared layer made there must be normal tensors (an inference tensor has no version counter,
    which the copies and the layer are keyed by), so the grad-enabled forwards of C6/C7 after it run."""
    prov = _cpu_vllm_provider(monkeypatch)
    ws = [torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64) * 0.1) for _ in range(2)]
    quant = QuantizedCopies((16, 16), tmp_path)
    for i, w in enumerate(ws):
        quant.register(f"w{i}", w)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.inference_mode():
        first = prov.fp8_linear(x, *quant.joined(ws), None, (16, 16), checkpoint=tmp_path)
    codes, scales = quant.joined(ws)
    assert not codes.is_inference() and not scales.is_inference()
    again = prov.fp8_linear(x, codes, scales, None, (16, 16), checkpoint=tmp_path)
    assert torch.equal(first, again)
    assert [c[0] for c in fp8_method_calls].count("prepare") == 1  # the layer made in inference mode is reused
    with torch.inference_mode():  # a copy that is itself an inference tensor: served, never cached
        inf_codes, inf_scales = codes.clone(), scales.clone()
    assert torch.equal(prov.fp8_linear(x, inf_codes, inf_scales, None, (16, 16), checkpoint=tmp_path), first)


def test_experts_get_vllms_fp8_block_quant_config(monkeypatch):
    seen = {}
    _modules(monkeypatch, **{
        "vllm.model_executor.layers.fused_moe": dict(fused_experts=lambda *a, **k: seen.update(args=a, kw=k) or a[0]),
        "vllm.model_executor.layers.fused_moe.config": dict(fp8_w8a8_moe_quant_config=lambda **k: ("fp8", k))})
    prov = _cpu_vllm_provider(monkeypatch)
    gu_q, gu_s = quantize_weight_blocks(torch.randn(4, 32, 16), (16, 16))
    d_q, d_s = quantize_weight_blocks(torch.randn(4, 16, 16), (16, 16))
    x, weights, ids = torch.randn(3, 16), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 0]])
    prov.fp8_moe_experts(x, weights, ids, gu_q, gu_s, d_q, d_s, (16, 16))
    assert seen["args"][1] is gu_q and seen["args"][2] is d_q and seen["args"][4].dtype == torch.int32
    kind, kw = seen["kw"]["quant_config"]
    assert kind == "fp8" and kw["w1_scale"] is gu_s and kw["w2_scale"] is d_s and kw["block_shape"] == [16, 16]


@pytest.mark.parametrize("batch", ["mixed", "right-padded"])
def test_fp8_kv_cache_round_trip_through_the_cache_kernel_and_the_same_attention_call(monkeypatch, batch):
    """Stand-ins: reshape_and_cache_flash writes e4m3 codes (scale 1) at the slots, scaled_fp8_quant quantizes the
    query, the varlen kernel reads the FP8 pages through the block table. The result must be attention over the
    FP8-rounded q, k and v on every valid token, for a scattered and a rows-as-pages batch."""
    from tic.harness.kernels.vllm_provider import VLLMProvider

    def reshape_and_cache_flash(k, v, k_cache, v_cache, slots, dtype, k_scale, v_scale):
        assert dtype == "fp8" and k_cache.dtype == torch.uint8 and float(k_scale) == 1.0
        for src, cache in ((k, k_cache), (v, v_cache)):
            cache.view(torch.float8_e4m3fn).view(-1, *src.shape[1:])[slots] = src.to(torch.float8_e4m3fn)

    def scaled_fp8_quant(x, scale):
        return (x / scale).to(torch.float8_e4m3fn), scale

    def varlen(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, q_descale, k_descale, v_descale,
               **kw):
        assert q.dtype == k.dtype == torch.float8_e4m3fn and q_descale.shape == (len(seqused_k), k.shape[2])
        cu = cu_seqlens_q.tolist()
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            ks, vs = (torch.cat([c[blk] for blk in block_table[s].tolist()])[:b - a].float() for c in (k, v))
            out[a:b] = ag.attention_ref(q[a:b].float().transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                        vs.transpose(0, 1)[None], None, softmax_scale)[0].to(out.dtype)

    monkeypatch.setattr(VLLMProvider, "_find_varlen_attention", staticmethod(lambda: varlen))
    prov = _cpu_vllm_provider(monkeypatch, "fp8", block=4)
    prov.fa_version = 3
    prov.vops = types.SimpleNamespace(reshape_and_cache_flash=reshape_and_cache_flash,
                                      scaled_fp8_quant=scaled_fp8_quant)
    ar = torch.arange(6)
    causal = ar[None, :] <= ar[:, None]
    right = lambda n: causal & (ar[None, :] < n)  # noqa: E731
    mask = torch.stack({"mixed": [causal & (ar[None, :] >= 2) & (ar[:, None] >= 2), right(4)],
                        "right-padded": [right(4), right(6)]}[batch])[:, None]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    got = prov.attention(q, k, v, mask, 0.35)
    fp8 = lambda t: t.to(torch.float8_e4m3fn).float()  # noqa: E731
    want = CPUProvider().attention(fp8(q), fp8(k), fp8(v), mask, 0.35)
    valid = mask[:, 0].diagonal(dim1=1, dim2=2)
    assert torch.allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6)
    plain = CPUProvider().attention(q, k, v, mask, 0.35)
    assert not torch.allclose(got[valid], plain[valid], rtol=1e-3, atol=1e-4)  # the round trip is not skipped
    assert bool(prov._layout(mask, 2, 6, "cpu", 4)[1].row_pages) == (batch == "right-padded")


@pytest.mark.parametrize("rollout, train, refused", [("fp8", None, True), (None, "fp8", True), ("fp8", "fp8", False),
                                                     ("fp8_e4m3", "fp8", False), (None, None, False)])
def test_a_train_side_on_vllm_kernels_must_name_the_rollouts_kv_cache_dtype(example, workdir, tic, rollout, train,
                                                                            refused):
    """Refused (one line, exit 2) when the two differ; otherwise the next refusal on this CPU machine is the GPU's."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ex = example("tiny-qwen3")
    opt = lambda v: f", options: {{kv_cache_dtype: {v}}}" if v else ""  # noqa: E731
    (ex / "kv.yaml").write_text("model: {path: ., generate: {seed: 0}}\n"
                                f"rollout: {{engine: vllm{opt(rollout)}}}\n"
                                f"train: {{engine: hf, kernels: vllm, device: cuda{opt(train)}}}\n")
    code, _, err = tic("gate", "C5", "-c", str(ex / "kv.yaml"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert ("kv_cache_dtype" in err) == refused, err


@pytest.mark.parametrize("op, neox", [("rotary", True), ("rotary_interleaved", False)])
def test_rotary_calls_vllms_kernel_with_the_models_pairing(monkeypatch, op, neox):
    """vLLM's rotary_embedding kernel in place on flat q/k copies: neox style for rotary, is_neox False for the
    interleaved rotation (GLM, as vLLM's GLM layers set it); with the stand-in kernel the result is tic's own
    rotation of that style."""
    import types

    from tic.harness.kernels.rope import rotate_interleaved, rotate_neox

    seen = []

    def rotary_embedding(positions, q, k, head, cos_sin, is_neox):
        seen.append(is_neox)
        rotate = rotate_neox if is_neox else rotate_interleaved
        for t in (q, k):
            t.copy_(rotate(t.view(t.shape[0], -1, head), positions, cos_sin).reshape(t.shape))

    prov = _cpu_vllm_provider(monkeypatch)
    prov.vops = types.SimpleNamespace(rotary_embedding=rotary_embedding)
    g = torch.Generator().manual_seed(0)
    q, k, table = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(9, 4, generator=g)
    pos = torch.tensor([0, 3, 1, 8, 2])
    got_q, got_k = getattr(prov, op)(q, k, pos, table)
    rotate = rotate_neox if neox else rotate_interleaved
    assert seen == [neox] and torch.equal(got_q, rotate(q, pos, table)) and torch.equal(got_k, rotate(k, pos, table))


def test_the_rotary_table_is_computed_where_and_as_vllm_builds_it():
    """vLLM builds get_rope's cos|sin table on the model's device with the model's dtype as default; get_rope may
    hand back a cached module built elsewhere, so the provider computes the table again under those settings."""
    from tic.harness.kernels.vllm_provider import _table_as_vllm_builds_it

    seen = {}

    class Rope:
        cos_sin_cache = torch.zeros(2, 2)  # a table built elsewhere: never the one returned

        def _compute_cos_sin_cache(self):
            seen["dtype"], seen["device"] = torch.get_default_dtype(), torch.empty(0).device
            return torch.arange(4, dtype=torch.float).reshape(2, 2) / 3

    before = torch.get_default_dtype()
    table = _table_as_vllm_builds_it(Rope(), torch.device("meta"), torch.bfloat16)
    assert seen == {"dtype": torch.bfloat16, "device": torch.device("meta")}
    assert table.dtype == torch.bfloat16 and table.device.type == "meta"
    assert torch.get_default_dtype() == before
    cpu = _table_as_vllm_builds_it(Rope(), torch.device("cpu"), torch.bfloat16)
    assert torch.equal(cpu, (torch.arange(4, dtype=torch.float).reshape(2, 2) / 3).to(torch.bfloat16))
