"""The locator on layouts its first tests did not cover (issue 11): byte comparisons of tensors with any strides,
operator calls attributed to tokens by data whatever the loop order, module replay with every tensor input of
the other side, and repros that say whether they show one operator on identical inputs or two implementations."""

from __future__ import annotations

import copy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tic.harness.locate.hf_capture import HFCaptureRunner
from tic.harness.locate.recorder import OpRecorder
from tic.harness.locate.replay import bytes_of
from tic.harness.locate.trail import Trail, same_bits
from tic.harness.engines.base import Sampling
from tic.harness.engines.hf import HFEngine
from tic.harness.locate import report
from tic.harness.locate.search import Side, _key, locate, trail_rows
from tic.harness.locate.provenance import Provenance
from tic.config.schema import load_config
from tic.skill.context import GateContext

ROOT = Path(__file__).resolve().parent.parent
DENSE = ROOT / "examples" / "tiny-qwen3"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _engines():
    ctx = GateContext(load_config(DENSE / "tic-consistent.yaml"))
    a = HFEngine(ctx.model.dir, "float32", kernels="consistent", batch_size=4, micro_batch_size=2)
    b = HFEngine(ctx.model.dir, "float32", kernels="consistent", batch_size=4, micro_batch_size=2)
    a.model = copy.deepcopy(a.model)
    b.model = copy.deepcopy(a.model)
    return a, b


def _run(a, b, out: Path, upto: int = 2):
    sp = Sampling(temperature=1.0, max_tokens=upto + 1, seed=0)
    prompts = [[5, 17, 99, 3, 250, 31], [7, 8, 9], [400, 2, 77, 13, 14]]
    samples = a.generate(prompts, sp, [0, 1, 2])
    ra, rb = HFCaptureRunner(a), HFCaptureRunner(b)
    return report.write(locate(Side("decode", ra, lambda s: ra.decode(samples, 0, upto, s)),
                               Side("score", rb, lambda s: rb.score(samples, 0, s)), out, "plant", upto), out)


# -- 1. bytes of any layout -------------------------------------------------------------------------------
def test_bytes_of_a_size_one_slice_with_a_large_stride():
    """A per-head tensor's one-row slice: shape (1,), stride 34. It counts as contiguous, so reinterpreting its
    storage as bytes used to fail ("stride(-1) must be 1 to view Float as Byte")."""
    base = torch.randn(1, 34)
    t = base.t()[0]
    assert t.shape == (1,) and t.stride() == (34,) and t.is_contiguous()
    assert bytes_of(t) == base[0, :1].numpy().tobytes()
    assert _key(t) == _key(base[0, :1].clone())
    assert same_bits(t, base[0, :1].clone()) and not same_bits(t, base[0, :1] + 1)
    heads = torch.randn(4, 34, 1).transpose(1, 2)  # (heads, 1, keys) with strides (34, 1, 1) after a transpose
    assert _key(heads[2]) == _key(heads[2].clone())


# -- 2. tokens by data, any loop order --------------------------------------------------------------------
def _projection_major(x, weights):
    """One projection over every row before the next (all q rows, then all k rows): a kernel's loop order."""
    rows = x.reshape(-1, x.shape[-1]).split(1, dim=0)
    per_proj = [[F.linear(r, w) for r in rows] for w in weights]
    return [torch.cat(p, dim=0) for p in per_proj]


def test_single_row_calls_are_attributed_to_their_token_by_data():
    g = torch.Generator().manual_seed(0)
    B, T, D = 1, 3, 8
    x = torch.randn(B, T, D, generator=g)
    weights = [torch.randn(D, D, generator=g) for _ in range(2)]
    for f in range(B * T):
        trail = Trail([], B, T, f)
        prov = Provenance(B, T)
        prov.seed(x)
        with OpRecorder(trail.calls, trail.errors, provenance=prov):
            _projection_major(x, weights)
        outs, _ = trail_rows(trail)
        got = [v for per in outs for (_, _, v, _) in per if v.numel() == D]
        want = [F.linear(x.reshape(-1, D)[f:f + 1], w)[0] for w in weights]
        # the traced token's own projections, each exactly once among the single-row calls' values
        for w_val in want:
            assert sum(bool(torch.equal(v.reshape(-1), w_val)) for v in got) >= 1
        others = [F.linear(x.reshape(-1, D)[j:j + 1], w)[0] for j in range(B * T) if j != f for w in weights]
        assert not any(torch.equal(v.reshape(-1), o) for v in got for o in others), f


def test_projection_major_kernel_is_located_at_its_planted_operator(tmp_path, monkeypatch):
    """Side B's MLP runs its projections one over every row before the next and rounds the up projection
    through bfloat16 (from the third row on); the traced token's own calls must be compared, so the answer
    is the rounding."""
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    mlp = b.model.model.layers[1].mlp

    def forward(self, x):
        shape = x.shape
        gate, up = _projection_major(x, [self.gate_proj.weight, self.up_proj.weight])
        # rounded from the third row on: the first differing token is not the first row, so calls attributed
        # by their order would compare another token's projections
        up = torch.cat([up[:2], up[2:].to(torch.bfloat16).to(up.dtype)])
        h = F.silu(gate) * up
        (out,) = _projection_major(h, [self.down_proj.weight])
        return out.reshape(*shape[:-1], out.shape[-1])

    mlp.forward = types.MethodType(forward, mlp)
    res = _run(a, b, tmp_path / "out")
    assert res["first_divergent_layer"] == "model.layers.1"
    assert res["culprit_module"] == "model.layers.1.mlp"
    assert res["first_operator"] in ("aten.to.dtype", "aten._to_copy.default"), res["first_operator"]


# -- 3. replay substitutes every tensor input -------------------------------------------------------------
def test_replay_feeds_keyword_inputs_so_a_layers_own_change_stays_in_the_layer(tmp_path, monkeypatch):
    """Side B's decoder layer rounds the position embeddings it passes to its attention. Fed side A's hidden
    states only, the attention would still see side B's rounded cos and be blamed; fed all of side A's inputs
    it agrees, and the layer's own forward is the culprit."""
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    for m in (a.model, b.model):  # both sides' attention reads the cos it is passed (kernels may use a table)
        attn = m.model.layers[2].self_attn
        attn_inner = attn.forward

        def attn_forward(*args, _inner=attn_inner, **kwargs):
            out = _inner(*args, **kwargs)
            cos = kwargs["position_embeddings"][0]
            return (out[0] * (1 + cos[..., :1] / 64),) + tuple(out[1:])

        attn.forward = attn_forward
    layer = b.model.model.layers[2]
    inner = layer.forward

    def forward(*args, **kwargs):
        cos, sin = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = (cos.to(torch.bfloat16).to(cos.dtype), sin)
        return inner(*args, **kwargs)

    layer.forward = forward
    res = _run(a, b, tmp_path / "out")
    assert res["first_divergent_layer"] == "model.layers.2"
    assert res["culprit_module"] == "model.layers.2", res["module_trail"]
    assert res["first_operator"] in ("aten.to.dtype", "aten._to_copy.default"), res["first_operator"]


# -- 4. a repro says what it shows ------------------------------------------------------------------------
def test_split_k_repro_names_the_argument_that_differs_not_one_operator(tmp_path, monkeypatch):
    """Split-K on one side: a partial GEMM against the full one. The repro reproduces (exit 1) but must not
    present two calls on different inputs as one operator on the same arguments: it names the argument."""
    monkeypatch.chdir(tmp_path)
    a, b = _engines()
    down = b.model.model.layers[1].mlp.down_proj
    h = down.weight.shape[1] // 2

    def split_k(self, x):
        w = self.weight
        rows = x.reshape(-1, x.shape[-1]).split(1, dim=0)
        out = torch.cat([F.linear(r[:, :h], w[:, :h]) + F.linear(r[:, h:], w[:, h:]) for r in rows], dim=0)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    down.forward = types.MethodType(split_k, down)
    res = _run(a, b, tmp_path / "out")
    assert res["culprit_module"] == "model.layers.1.mlp.down_proj"
    assert res["repro"] and res["repro_check"]["exit_code"] == 1
    want = (f"same operator, arguments that differ: argument 0 (input): the traced token's part has {2 * h} "
            f"elements on side A, {h} on side B")
    assert res["repro_proves"] == want, res["repro_proves"]
    assert res["difference"]["kind"] == "same operator, arguments that differ"
    origins = res["difference"]["origins"]  # each side's row: views of the module's input, B's cut in half
    assert origins["A"].endswith("of the module's input") and "aten.slice" in origins["B"], origins
    assert not res["repro_check"]["same_operator_identical_inputs"]
    script = Path(res["repro"]).read_text()
    assert "What it shows: same operator, arguments that differ" in script
    out = subprocess.run([sys.executable, res["repro"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"PROVES: {want}" in out.stdout, out.stdout


def test_fresh_process_says_identical_calls_show_nothing(tmp_path):
    """The script's own check, run in the fresh process, calls identical calls one operator on the same
    arguments; their bits being equal, the candidate is not emitted."""
    from tic.harness.locate import repro
    from tic.harness.locate.trail import OpCall
    from tic.harness.locate.replay import SAME_ARGUMENTS
    from tic.harness.locate.repro import OpSide

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    call = OpCall("aten.mm.default", torch.ops.aten.mm.default, (x, w), {}, (x @ w,))
    side = OpSide(call, {"kind": "row", "output": 0, "row": 1}, 3)
    res = repro.emit(tmp_path, "C5", side, side, None, "a", "b", "claim check")
    assert res["proves"].startswith(SAME_ARGUMENTS) and res["exit_code"] == 0 and not res["reproduces"]
    # equal bits prove nothing: the script says what it checked, and claims no proof
    assert f"CHECKS: {SAME_ARGUMENTS}" in res["output"] and "PROVES:" not in res["output"]


# -- 5. per-head module rows ------------------------------------------------------------------------------
def test_token_layouts_per_token_per_row_and_per_head():
    """A [B, H, T, D] tensor (attention's q after its transpose, what Gemma-3's q_norm takes) holds tokens as
    [B, T, ...] and [B*T, ...] do; H == T is told apart by the strides of a transposed view."""
    from tic.harness.locate.provenance import standard_map, token_view

    B, T, H, D = 2, 3, 4, 5
    x = torch.randn(B, T, H, D)
    for layout in (x, x.reshape(B * T, H, D), x.transpose(1, 2)):
        view = token_view(layout, B, T)
        assert view is not None and torch.equal(view.reshape(B, T, -1), x.reshape(B, T, -1))
        m = standard_map(layout, B, T)
        tokens = token_view(m, B, T).reshape(B, T, -1)
        assert torch.equal(tokens, torch.arange(B * T, dtype=torch.int32).reshape(B, T, 1).expand(B, T, H * D))
    square = torch.randn(B, T, T, D)  # H == T
    assert torch.equal(token_view(square.transpose(1, 2), B, T), square)  # taken per head: the view's strides
    assert token_view(square, B, T) is square  # a dense [B, T, T, D]: per token
    assert token_view(torch.randn(B, 7, D), B, T) is None
    # an attention mask [B, 1, T, K] is laid out per query, but its row says which keys, placed by the layout's
    # padding: not a token's values, so never compared or fed to the other side as one
    assert token_view(torch.ones(B, 1, T, 6, dtype=torch.bool), B, T) is None


GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=128, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=True, dtype="float32", rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=4, sliding_window_pattern=2,
              query_pre_attn_scalar=16)


def test_a_per_head_norm_is_compared_by_its_rows_not_blamed_for_rows_it_did_not_show(tmp_path, monkeypatch, tic):
    """Gemma-3's q_norm/k_norm take [B, H, T, D]: the prefill side's rows used not to be seen as token rows, so
    the norm "differed on identical inputs" with 0 ulp and no operator pair or repro. Its rows are compared now
    (equal), and the locator goes on to the attention's own arithmetic with a repro that exits 1."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    (tmp_path / "tic.yaml").write_text(
        "model: {path: ., dtype: float32, generate: {seed: 0}}\n"
        "rollout: {engine: hf, kernels: stock, batch_size: 8}\n"
        "train: {engine: hf, kernels: stock, micro_batch_size: 4, padding_side: right}\n"
        "prompts: {source: random, count: 8, seed: 0, min_len: 4, max_len: 24}\n"
        "sampling: {temperature: 1.0, max_tokens: 8, seed: 0}\n")
    code, out, _ = tic("locate", "-c", str(tmp_path / "tic.yaml"), "--gate", "C4", "--json")
    assert code == 1
    found = json.loads(out)
    assert found["culprit_module"] == "model.layers.0.self_attn", found["module_trail"]
    report = json.loads((tmp_path / ".tic" / "artifacts" / "C4" / "locate" / "locate.json").read_text())
    siblings = {s["module"]: s for d in report["module_trail"] for s in d["siblings"]}
    for norm in ("q_norm", "k_norm"):
        assert not siblings[f"model.layers.0.self_attn.{norm}"]["diverges"], siblings
    assert all(s["max_ulp"] > 0 for s in siblings.values() if s["diverges"])  # nothing "differs" by 0 ulp
    assert found["repro_check"]["reproduces"] and found["repro_check"]["exit_code"] == 1, found["repro_check"]


class _Twice(torch.nn.Module):
    """One module (a linear standing for a shared norm or rotary) called twice per forward, on other inputs."""

    def __init__(self):
        super().__init__()
        self.embed, self.inner = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4)

    def forward(self, ids):
        x = self.embed(ids)
        return self.inner(x * 2) + self.inner(x * 3)


@pytest.mark.parametrize("layout", ["hf padded batch", "vllm flat tokens"])
def test_a_module_called_twice_in_a_forward_is_traced_at_the_call_whose_rows_are_kept(layout):
    """Gemma-3's rotary module runs once per attention kind in each forward; the capture keeps its last call's
    rows, so the trail must be that call's (the module's output was not found among the first call's operators,
    and no repro could be made). HF's padded batch [B, T] and vLLM's flat step [num_tokens] are traced alike."""
    from tic.harness.locate.capture import CaptureSpec, HookSet
    from tic.harness.locate.hf_capture import PaddedRows
    from tic.harness.locate.search import module_target
    from tic.harness.locate.vllm_capture import FlatRows

    torch.manual_seed(0)
    model = _Twice()
    ids = torch.tensor([[1, 2, 3]]) if layout.startswith("hf") else torch.tensor([1, 2, 3])
    rows = PaddedRows() if layout.startswith("hf") else FlatRows(lambda n: [(j, j) for j in range(n)], set(), "embed")
    spec = CaptureSpec(outputs={"inner"}, trail_module="inner", trail_position=1)
    with torch.inference_mode(), HookSet(dict(model.named_modules()), spec, rows) as hooks:
        if layout.startswith("hf"):
            hooks.step(torch.arange(3)[None])
        model(ids)
    row = hooks.capture.outputs["inner"][1][0]
    assert torch.equal(row, model.inner(model.embed(ids) * 3).reshape(3, 4)[1].detach())
    assert hooks.capture.forwards == 1 and hooks.capture.trail.flat_index == 1
    assert module_target(hooks.capture.trail, row) is not None
