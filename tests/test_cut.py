"""tic cut and gate C2 on tiny generated checkpoints of every supported family.

Each family: a full model (8 layers, mixed kinds where the family has them) is cut with layers=auto, the cut
loads with transformers and C2 passes; then planted errors (swapped layer, dropped tensor, stale per-layer
config) each make C2 fail with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from tic.harness.model.cut_check import check_cut  # noqa: E402
from tic.harness.model.cut import choose_layers, cut_model  # noqa: E402
from tic.harness.model.cut_config import rewrite_config  # noqa: E402
from tic.harness.model.families import layer_kinds  # noqa: E402
from tic.harness.model.inventory import tensor_locations  # noqa: E402
from tic.core.errors import TicInputError  # noqa: E402

BASE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
            dtype="float32", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
SLIDING = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
           "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
CONFIGS = {
    "llama": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"]),
    # layer-specific quantization: scale tensors on layers 4-7 only (planted after generation)
    "llama_quant": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], initializer_range=0.03),
    "qwen2": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], dtype="bfloat16",
                  use_sliding_window=True, sliding_window=4, max_window_layers=5),
    "qwen3": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True,
                  sliding_window=4, layer_types=SLIDING),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0, 1, 5],
                      decoder_sparse_step=1),
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_next": dict(BASE, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[0, 1]),
    "nemotron_h": dict(BASE, model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
                       hybrid_override_pattern="M-M-M*-E", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                       n_groups=1, mamba_chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
}
FAMILY_IDS = list(CONFIGS)
SCALE = "self_attn.q_proj.weight_scale_inv"


def _plant_scales(model_dir: Path) -> None:
    """Give layers 4-7 a float32 scale tensor, as a checkpoint quantized from layer 4 on would have."""
    f = next(model_dir.glob("*.safetensors"))
    sd = load_file(f)
    for i in range(4, 8):
        sd[f"model.layers.{i}.{SCALE}"] = torch.full((1,), 0.5 + i, dtype=torch.float32)
    save_file(sd, f, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """family -> (full model dir, auto cut dir, cut record)."""
    from tic.harness.model.generate import generate_model

    root = tmp_path_factory.mktemp("cut")
    out = {}
    for fam, cfg in CONFIGS.items():
        src = root / "src" / fam
        src.mkdir(parents=True)
        (src / "config.json").write_text(json.dumps(cfg))
        full = generate_model(src, seed=0, out_dir=root / "full" / fam)
        if fam == "llama_quant":
            _plant_scales(full)
        cut = root / "cut" / fam
        rec = cut_model(full, cut, layers="auto", max_layers=6)
        out[fam] = (full, cut, rec)
    return out


_CHECKS: dict[str, dict] = {}


def _check(full: Path, cut: Path) -> dict:
    key = f"{full}|{cut}"
    if key not in _CHECKS:
        _CHECKS[key] = check_cut(full, cut)
    return _CHECKS[key]


def _copy_cut(cut: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "cut"
    shutil.copytree(cut, dst)
    return dst


def _edit_tensors(cut: Path, fn) -> None:
    """Apply fn(state_dict) -> state_dict to the cut's shards and rewrite the index."""
    idx_path = cut / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    sd = {}
    for f in sorted(cut.glob("*.safetensors")):
        sd.update(load_file(f))
        f.unlink()
    sd = fn(sd)
    save_file(sd, cut / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    idx["weight_map"] = {k: "model-00001-of-00001.safetensors" for k in sorted(sd)}
    idx_path.write_text(json.dumps(idx))


# --- every family: auto cut -> loads -> C2 passes -------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILY_IDS)
def test_auto_cut_passes_c2(models, fam):
    full, cut, rec = models[fam]
    assert 4 <= len(rec["layers"]) <= 6
    r = _check(full, cut)
    assert r["problems"] == [], r["problems"]
    assert r["fidelity"] and all(x["equal"] for x in r["fidelity"])
    assert not r["missing_classes"] and not r["missing_transitions"]


@pytest.mark.parametrize("fam", FAMILY_IDS)
def test_planted_swapped_layer_fails_c2(models, fam, tmp_path):
    full, cut, rec = models[fam]
    bad = _copy_cut(cut, tmp_path)
    # swap the tensors of cut layers 0 and 1 (names exchanged, data untouched)
    def swap(sd):
        out = {}
        for k, v in sd.items():
            k2 = k.replace("layers.0.", "layers.@.").replace("layers.1.", "layers.0.").replace("layers.@.", "layers.1.")
            out[k2] = v
        return out
    _edit_tensors(bad, swap)
    r = check_cut(full, bad)
    assert r["problems"], "a swapped layer must fail C2"
    assert any("source" in p and ("not bitwise equal" in p or "missing" in p or "differs" in p or " is " in p)
               for p in r["problems"]), r["problems"]


@pytest.mark.parametrize("fam", FAMILY_IDS)
def test_planted_dropped_tensor_fails_c2(models, fam, tmp_path):
    full, cut, rec = models[fam]
    bad = _copy_cut(cut, tmp_path)
    holder = {}

    def drop(sd):
        scales = sorted(k for k in sd if k.endswith("weight_scale_inv"))
        victim = scales[0] if scales else sorted(k for k in sd if ".layers.1." in k)[0]
        holder["victim"] = victim
        return {k: v for k, v in sd.items() if k != victim}
    _edit_tensors(bad, drop)
    r = check_cut(full, bad)
    rel = holder["victim"].split(".layers.", 1)[1].split(".", 1)[1]
    assert any(f"tensor {rel} missing" in p for p in r["problems"]), r["problems"]


def _stale(cfg: dict, src_cfg: dict, kept: list[int]) -> dict:
    """A per-layer field left as the source had it, or taken from the wrong layers."""
    for key in ("layer_types", "layers_block_type", "mlp_only_layers"):
        if isinstance(src_cfg.get(key), list) and src_cfg[key]:
            n = len(layer_kinds(src_cfg))
            want = cfg[key]
            if key == "mlp_only_layers":
                cands = [list(src_cfg[key]), [j for j in range(len(kept)) if j not in want]]
            else:
                cands = [[src_cfg[key][(i + s) % n] for i in kept] for s in range(1, n)] + [src_cfg[key]]
            for c in cands:
                if c != want:
                    return {**cfg, key: c}
    return {**cfg, "num_hidden_layers": src_cfg.get("num_hidden_layers", 8)}


@pytest.mark.parametrize("fam", FAMILY_IDS)
def test_planted_stale_layer_config_fails_c2(models, fam, tmp_path):
    full, cut, rec = models[fam]
    bad = _copy_cut(cut, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    src_cfg = json.loads((full / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(_stale(cfg, src_cfg, rec["layers"])))
    r = check_cut(full, bad)
    assert any(k in p for p in r["problems"] for k in ("differs from source", "cut config declares",
                                                        "built differently", "missing weights")), r["problems"]


# --- what moves with the layers ---------------------------------------------------------------------------
def test_kept_tensor_bytes_are_identical(models):
    full, cut, rec = models["qwen2"]  # bf16 source
    src, dst = tensor_locations(full), tensor_locations(cut)
    assert {t["dtype"] for t in dst.values()} == {"BF16"}
    for j, i in enumerate(rec["layers"]):
        for name, t in src.items():
            if f".layers.{i}." not in name:
                continue
            d = dst[name.replace(f".layers.{i}.", f".layers.{j}.")]
            a = t["path"].read_bytes()[t["start"]:t["end"]]
            b = d["path"].read_bytes()[d["start"]:d["end"]]
            assert a == b and t["dtype"] == d["dtype"] and t["shape"] == d["shape"]


def test_copy_paths_write_the_same_bytes(models, tmp_path, monkeypatch):
    """Several copies in flight (default), one at a time, and the pread/pwrite fallback for systems without
    copy_file_range all write byte-identical shards (each tensor lands in its own byte range)."""
    import os

    from tic.harness.model import cut as cut_mod

    full, cut, rec = models["qwen3_moe"]
    ref = {p.name: p.read_bytes() for p in cut.glob("*.safetensors")}
    monkeypatch.setattr(cut_mod, "_COPY_CHUNK", 1000)  # many chunks per tensor: the offsets must add up
    monkeypatch.setattr(cut_mod, "_COPY_THREADS", 1)
    cut_model(full, tmp_path / "serial", layers=rec["layers"])
    monkeypatch.setattr(cut_mod, "_COPY_THREADS", 8)
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    cut_model(full, tmp_path / "pwrite", layers=rec["layers"])
    for d in ("serial", "pwrite"):
        got = {p.name: p.read_bytes() for p in (tmp_path / d).glob("*.safetensors")}
        assert got == ref, d


def test_auto_choice_covers_quant_transition(models):
    full, cut, rec = models["llama_quant"]
    assert any(i >= 4 for i in rec["layers"]) and any(i < 4 for i in rec["layers"])
    assert 3 in rec["layers"] and 4 in rec["layers"], rec["explanation"]
    names = tensor_locations(cut)
    assert any(k.endswith(SCALE) for k in names)


def test_choose_layers_covers_every_transition_and_refuses_when_too_many():
    sigs = list("AABBBBCCAA")
    plan = choose_layers(sigs, max_layers=6)
    kept = set(plan.layers)
    for a, b in {(sigs[i], sigs[i + 1]) for i in range(len(sigs) - 1) if sigs[i] != sigs[i + 1]}:
        assert any(i in kept and i + 1 in kept and (sigs[i], sigs[i + 1]) == (a, b) for i in range(len(sigs) - 1))
    with pytest.raises(TicInputError, match="max-layers"):
        choose_layers(list("ABACADAEAF"), max_layers=4)


def test_rewrite_config_moves_every_per_layer_field():
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 10, "n_routed_experts": 4, "first_k_dense_replace": 3,
           "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
           "quantization_config": {"quant_method": "fp8", "ignore": ["lm_head", "model.layers.2.mlp.gate",
                                                                     "model.layers.5.mlp.gate"]}}
    new, notes = rewrite_config(cfg, [1, 2, 3, 4])
    assert new["num_hidden_layers"] == 4 and new["first_k_dense_replace"] == 2 and new["num_nextn_predict_layers"] == 0
    assert new["quantization_config"]["ignore"] == ["lm_head", "model.layers.1.mlp.gate"]
    assert any("num_nextn_predict_layers: 1 -> 0" in n for n in notes)
    pat = {"model_type": "nemotron_h", "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*-E"}
    assert rewrite_config(pat, [2, 3, 4, 5])[0]["hybrid_override_pattern"] == "M*-E"


def test_rewrite_config_slices_a_per_layer_field_no_table_names():
    """A per-layer list the family table has never seen moves with its layers (and is proven on meta)."""
    cfg = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 2, "vocab_size": 64, "rope_per_layer": [1, 2, 3, 4, 5, 6]}
    new, _ = rewrite_config(cfg, [1, 2, 4])
    assert new["rope_per_layer"] == [2, 3, 5] and new["num_hidden_layers"] == 3


def test_rewrite_config_prefers_the_rule_the_family_table_agrees_with():
    """transformers' DeepSeek-V3 ignores moe_layer_freq, vLLM reads it: among proven rewrites, the one the
    family table (which models moe_layer_freq) agrees with wins."""
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "n_routed_experts": 4, "first_k_dense_replace": 2,
           "moe_layer_freq": 2}
    new, notes = rewrite_config(cfg, [2, 3, 4, 5])  # table: moe, dense, moe, dense -> k=0, freq=2
    assert (new["first_k_dense_replace"], new["moe_layer_freq"]) == (0, 2)
    assert notes[0].startswith("config rewrite: family hint")


# --- CLI and gate ------------------------------------------------------------------------------------------
def test_cli_cut_explains_and_bad_layers_exit_2(models, tmp_path, tic):
    full, _, _ = models["qwen3"]
    code, out, err = tic("cut", str(full), str(tmp_path / "c"), "--layers", "2,3,4,5")
    assert code == 0, err
    assert "layer 3:" in out and "wrote" in out
    code, out, err = tic("cut", str(full), str(tmp_path / "d"), "--layers", "2,99")
    assert code == 2 and err.count("\n") == 1 and "out of range" in err
    assert not (tmp_path / "d").exists()


def _yaml(tmp_path: Path, full: Path, cut_out: Path | None) -> Path:
    y = tmp_path / "tic.yaml"
    text = f"model:\n  path: {full}\n  dtype: float32\nstate_dir: {tmp_path / '.tic'}\n"
    if cut_out is not None:
        text += f"cut:\n  out: {cut_out}\n"
    y.write_text(text)
    return y


def test_gate_c2_passes_through_cli(models, tmp_path, tic):
    full, _, _ = models["qwen3_moe"]
    code, out, err = tic("gate", "C2", "-c", str(_yaml(tmp_path, full, None)), "--json")
    assert code == 0, out + err
    assert (tmp_path / ".tic" / "artifacts" / "C2" / "cut" / "cut.json").is_file()


def test_gate_c2_fails_through_cli_on_broken_cut(models, tmp_path, tic):
    full, cut, _ = models["qwen3_moe"]
    bad = _copy_cut(cut, tmp_path)
    _edit_tensors(bad, lambda sd: {k: v for k, v in sd.items() if "layers.2.mlp" not in k})
    code, out, err = tic("gate", "C2", "-c", str(_yaml(tmp_path, full, bad)), "--json")
    assert code == 1, out + err
    rec = json.loads((tmp_path / ".tic" / "results" / "C2.json").read_text())
    assert rec["verdict"] == "fail" and "missing" in rec["reason"], rec["reason"]
