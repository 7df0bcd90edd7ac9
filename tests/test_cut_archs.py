"""tic cut on architectures of every kind transformers builds, none of them special-cased by the cutter.

Each architecture (tiny dims, seeded random weights, built from a config; never downloaded): the cut keeps
layers whose config rewrite is not trivial where the architecture allows it, is proven on meta, and passes
every C2 check. For each, a planted wrong rewrite (a per-layer field left as the source had it, as a
per-family rule table that does not know the field would leave it) is refused, by the meta proof and by C2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tic.core.errors import TicInputError  # noqa: E402
from tic.harness.model.cut import cut_model  # noqa: E402
from tic.harness.model.cut_check import check_cut  # noqa: E402
from tic.harness.model.cut_config import check_rewrite, rewrite_config  # noqa: E402
from tic.harness.model.inventory import tensor_locations  # noqa: E402
from tic.harness.model.layer_structure import text_config, with_text_config  # noqa: E402

B = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
         dtype="float32", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SLIDING = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
           "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
GEMMA3_TEXT = dict(B, model_type="gemma3_text", sliding_window=4, sliding_window_pattern=3)

# name -> (config.json, layers ('auto' or the kept source layers), text-config field a wrong rewrite leaves stale)
ARCHS = {
    "llama_dense": (dict(B, model_type="llama"), "auto", "num_hidden_layers"),
    "qwen3_layer_types": (dict(B, model_type="qwen3", use_sliding_window=True, sliding_window=4,
                               layer_types=SLIDING), "2,3,4,5", "layer_types"),
    "deepseek_v3_mla_moe_dense_first": (
        dict(B, model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             first_k_dense_replace=3, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, head_dim=8,
             num_nextn_predict_layers=1),
        "2,3,4,5", "first_k_dense_replace"),
    "gemma2_sliding": (dict(B, model_type="gemma2", sliding_window=4), "1,2,3,4", "layer_types"),
    "gemma3_sliding_pattern": (GEMMA3_TEXT, "1,2,3,4", "layer_types"),
    "qwen2_max_window_layers": (dict(B, model_type="qwen2", use_sliding_window=True, sliding_window=4,
                                     max_window_layers=5), "3,4,5,6", "layer_types"),
    "jamba_period_offset": (dict(B, model_type="jamba", num_experts=4, num_experts_per_tok=2, attn_layer_period=4,
                                 attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                 mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4), "3,4,5,6", "attn_layer_offset"),
    "bamba_attn_indices": (dict(B, model_type="bamba", attn_layer_indices=[3, 6], **MAMBA2), "2,3,4,5",
                           "attn_layer_indices"),
    "nemotron_h_pattern": (dict(B, model_type="nemotron_h", hybrid_override_pattern="M-M-M*-E", mamba_num_heads=4,
                                mamba_head_dim=8, ssm_state_size=8, n_groups=1, mamba_chunk_size=8,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
                           "auto", "layers_block_type"),
    "qwen3_next_linear_attention": (dict(B, model_type="qwen3_next", linear_num_value_heads=4, linear_num_key_heads=2,
                                         linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, decoder_sparse_step=1,
                                         mlp_only_layers=[0, 1]), "1,2,3,4", "layer_types"),
    "granitemoehybrid_mamba_moe": (dict(B, model_type="granitemoehybrid", num_local_experts=4, num_experts_per_tok=2,
                                        shared_intermediate_size=16, layer_types=["mamba", "mamba", "attention",
                                        "mamba", "mamba", "attention", "mamba", "mamba"], **MAMBA2),
                                   "1,2,3,4", "layer_types"),
    "lfm2_conv_attention": (dict(B, model_type="lfm2", full_attn_idxs=[2, 5], conv_L_cache=3), "1,2,3,4",
                            "layer_types"),
    "gemma3_multimodal_wrapper": (dict(model_type="gemma3", text_config=GEMMA3_TEXT, mm_tokens_per_image=4,
                                       vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=8,
                                                          num_attention_heads=2, image_size=8, patch_size=2),
                                       image_token_index=127, boi_token_index=125, eoi_token_index=126),
                                  "1,2,3,4", "layer_types"),
    "qwen2_vl_multimodal_wrapper": (dict(model_type="qwen2_vl", image_token_id=127, video_token_id=126,
                                         vision_start_token_id=125,
                                         text_config=dict(B, model_type="qwen2_vl_text", use_sliding_window=True,
                                                          sliding_window=4, max_window_layers=5,
                                                          rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                                         vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2,
                                                            patch_size=2, spatial_merge_size=1, temporal_patch_size=1)),
                                    "3,4,5,6", "layer_types"),
    "qwen3_block_fp8": (dict(B, model_type="qwen3", use_sliding_window=True, sliding_window=4, layer_types=SLIDING),
                        "2,3,4,5", "layer_types"),
    # layers in transformer.h, the layer count under GPT-2's own name (n_layer)
    "gpt2_transformer_h": (dict(B, model_type="gpt2", n_positions=256), "auto", "n_layer"),
    "falcon_transformer_h": ({**{k: v for k, v in B.items() if k != "head_dim"}, "model_type": "falcon"}, "2,3,4,5",
                             "num_hidden_layers"),
}
IDS = list(ARCHS)


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    """name -> (full model dir, cut dir, cut record); the block-FP8 model is quantized after generation."""
    from tic.harness.model.generate import generate_model
    from tic.harness.model.quantize import write_block_fp8

    root = tmp_path_factory.mktemp("archs")
    out = {}
    for name, (cfg, layers, _) in ARCHS.items():
        src = root / "src" / name
        src.mkdir(parents=True)
        (src / "config.json").write_text(json.dumps(cfg))
        full = generate_model(src, seed=0, out_dir=root / "full" / name)
        if name.endswith("fp8"):
            full = write_block_fp8(full, root / "fp8" / name, (16, 16))
        rec = cut_model(full, root / "cut" / name, layers=layers)
        out[name] = (full, root / "cut" / name, rec)
    return out


def _stale(src_cfg: dict, cut_cfg: dict, key: str, n_cut: int) -> dict:
    """The cut config with `key` left as the source had it (a per-layer list cut to length, not to the kept
    layers; a layer count or index rule unchanged)."""
    src, cut = text_config(src_cfg), dict(text_config(cut_cfg))
    val = src.get(key, cut.get(key))
    if isinstance(val, (list, str)) and len(val) > n_cut:
        val = val[:n_cut]
    elif key == "num_hidden_layers":
        val = n_cut + 1
    assert val != cut.get(key), f"the plant must change {key}"
    return with_text_config(cut_cfg, {**cut, key: val})


@pytest.mark.parametrize("name", IDS)
def test_cut_passes_c2(cuts, name):
    full, cut, rec = cuts[name]
    layers = ARCHS[name][1]
    if layers != "auto":
        assert rec["layers"] == [int(x) for x in layers.split(",")]
    assert 4 <= len(rec["layers"]) <= 6
    r = check_cut(full, cut)
    assert r["problems"] == [], r["problems"]
    assert r["fidelity"] and all(x["equal"] for x in r["fidelity"])
    assert not r["missing_classes"] and r["engines_checked"] == ["hf"]


@pytest.mark.parametrize("name", IDS)
def test_planted_wrong_rewrite_is_refused(cuts, name, tmp_path):
    full, cut, rec = cuts[name]
    src_cfg = json.loads((full / "config.json").read_text())
    bad_cfg = _stale(src_cfg, json.loads((cut / "config.json").read_text()), ARCHS[name][2], len(rec["layers"]))
    proof = check_rewrite(src_cfg, bad_cfg, rec["layers"])
    assert not proof.ok and ("cut layer" in proof.problem or "decoder layers" in proof.problem), proof.problem
    bad = tmp_path / "cut"
    shutil.copytree(cut, bad)
    (bad / "config.json").write_text(json.dumps(bad_cfg))
    r = check_cut(full, bad)
    assert any("differs from source in structure" in p or "cut config declares" in p for p in r["problems"]), \
        r["problems"]


def test_deepseek_dense_first_layers_rewritten_not_kept_as_moe(cuts):
    """The issue's case: layers 0-2 dense, MoE after; cutting 2..5 must make only the first cut layer dense."""
    full, cut, rec = cuts["deepseek_v3_mla_moe_dense_first"]
    cfg = json.loads((cut / "config.json").read_text())
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_hidden_layers"] == 4
    assert cfg["num_nextn_predict_layers"] == 0
    assert any("first_k_dense_replace: 3 -> 1" in n for n in rec["notes"])


def test_period_offset_rewritten(cuts):
    _, cut, _ = cuts["jamba_period_offset"]
    cfg = json.loads((cut / "config.json").read_text())
    # source: attention at 2, 6 (period 4, offset 2), experts at odd layers; kept 3..6 -> attention at cut 3
    assert (cfg["attn_layer_period"], cfg["attn_layer_offset"]) in {(4, 3), (8, 3)}
    assert cfg["expert_layer_offset"] % cfg["expert_layer_period"] == 0


def test_multimodal_wrapper_keeps_vision_tower(cuts):
    full, cut, rec = cuts["gemma3_multimodal_wrapper"]
    src, dst = tensor_locations(full), tensor_locations(cut)
    vision = [k for k in src if "vision_tower" in k]
    assert vision and all(k in dst for k in vision)  # all 8 vision layers, though the text stack keeps 4
    cfg = json.loads((cut / "config.json").read_text())
    assert cfg["vision_config"]["num_hidden_layers"] == 8 and cfg["text_config"]["num_hidden_layers"] == 4


def test_block_fp8_scales_and_config_carried(cuts):
    full, cut, rec = cuts["qwen3_block_fp8"]
    dst = tensor_locations(cut)
    assert {t["dtype"] for k, t in dst.items() if k.endswith("proj.weight")} == {"F8_E4M3"}
    scales = [k for k in dst if k.endswith("weight_scale_inv")]
    assert len(scales) == 7 * len(rec["layers"])
    q = json.loads((cut / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [16, 16]


def test_derived_layer_types_written_out():
    """A config that leaves layer_types to transformers (sliding_window_pattern=3: full attention at 2, 5):
    no pattern gives kept 1..4 (sliding, full, sliding, sliding), so the derived list is written out."""
    cfg = dict(GEMMA3_TEXT)
    new, notes = rewrite_config(cfg, [1, 2, 3, 4])
    assert new["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert check_rewrite(cfg, new, [1, 2, 3, 4]).ok
    assert not check_rewrite(cfg, {k: v for k, v in new.items() if k != "layer_types"}, [1, 2, 3, 4]).ok


def test_no_rewrite_reproduces_kept_layers_is_refused_naming_the_layer(cuts):
    """Attention at source layers 2 and 6 (period 4, offset 2): kept 1,2,6,7 puts attention at cut layers
    1 and 2, which no period/offset gives."""
    cfg = json.loads((cuts["jamba_period_offset"][0] / "config.json").read_text())
    with pytest.raises(TicInputError, match=r"no config rewrite .* cut layer \d \(source layer \d\)"):
        rewrite_config(cfg, [1, 2, 6, 7])


def test_cli_cut_runs_c2_and_exits_1_on_a_wrong_cut(cuts, tmp_path, tic, monkeypatch):
    full, _, _ = cuts["jamba_period_offset"]
    code, out, err = tic("cut", str(full), str(tmp_path / "ok"), "--layers", "3,4,5,6")
    assert code == 0, err
    assert "C2's checks pass" in out and "attn_layer_offset: 2 -> 3" in out
    from tic.harness.model import cut as cut_mod

    real = cut_mod.map_tensor_names

    def drop_one(*a, **k):  # a cutter bug: one kept tensor not copied
        mapping, notes = real(*a, **k)
        victim = sorted(s for s in mapping if ".layers.4." in s)[0]
        return {s: d for s, d in mapping.items() if s != victim}, notes
    monkeypatch.setattr(cut_mod, "map_tensor_names", drop_one)
    code, out, err = tic("cut", str(full), str(tmp_path / "bad"), "--layers", "3,4,5,6")
    assert code == 1 and err.count("\n") == 1 and "fails C2's checks" in err and "missing" in err, err


def test_cli_cut_refuses_unreproducible_layers_exit_2(cuts, tmp_path, tic):
    full, _, _ = cuts["jamba_period_offset"]
    code, out, err = tic("cut", str(full), str(tmp_path / "c"), "--layers", "1,2,6,7")
    assert code == 2 and err.count("\n") == 1 and "no config rewrite" in err and "cut layer" in err, err
    assert not (tmp_path / "c").exists()


def test_vllm_load_recorded_when_available(cuts, monkeypatch):
    """Where vLLM and a GPU are there, C2 also loads the cut in vLLM; a failure there fails the cut."""
    from tic.harness.model import cut_check

    full, cut, _ = cuts["llama_dense"]
    monkeypatch.setattr(cut_check, "vllm_available", lambda: True)
    monkeypatch.setattr(cut_check, "vllm_generates", lambda d: None)
    assert check_cut(full, cut)["engines_checked"] == ["hf", "vllm"]
    monkeypatch.setattr(cut_check, "vllm_generates", lambda d: "vLLM exited 1: unknown architecture")
    r = check_cut(full, cut)
    assert r["engines_checked"] == ["hf", "vllm"] and any("vLLM" in p for p in r["problems"])
