"""The tic.yaml settings a small generated model climbs C0-C7 with on CPU in a few seconds (after its `model:`
line): three random prompts, six sampled tokens, one layout probe, no locator; and the gate context of such a
model."""

import json

SMALL_LADDER = ("rollout: {engine: hf, kernels: consistent, batch_size: 3}\n"
                "train: {engine: hf, kernels: consistent, micro_batch_size: 2}\n"
                "prompts: {source: random, count: 3, seed: 0, min_len: 4, max_len: 12}\n"
                "sampling: {temperature: 1.0, max_tokens: 6, seed: 0}\n"
                "layouts: {batch_sizes: [3], positions: [first, last], probes: 1}\n"
                "locate: {enabled: false}\n")


def small_ladder_ctx(tmp_path, monkeypatch, config, dtype: str):
    """A generated model of `config` (float32 weights, run in `dtype`) under SMALL_LADDER. Its MoE routers are drawn
    wide enough that each token chooses for itself (at the init's 0.02 every sigmoid score is near 0.5 and a bias
    alone would choose), and their selection biases and logit biases drawn (a trained checkpoint's are not zero)."""
    import torch

    from tic.config.schema import load_config
    from tic.harness.engines import hf
    from tic.harness.kernels import coverage
    from tic.harness.model.layer_structure import model_from_config
    from tic.skill.context import GateContext

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    torch.manual_seed(0)
    model = model_from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():
            router = coverage.moe_router(m) if coverage.is_moe_block(m) else None
            if router is None:
                continue
            w, bias = coverage.router_weight(router), coverage.block_routing_bias(m)
            w.copy_(torch.randn(w.shape) * 2 / w.shape[1] ** 0.5)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.1)
            added = coverage.router_logit_bias_name(router)  # GPT-OSS's router linear bias
            if added is not None:
                getattr(router, added).copy_(torch.randn(w.shape[0]) * 0.5)
    model.save_pretrained(model_dir, safe_serialization=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}))
    run_dir = tmp_path / "run"  # beside the checkpoint: a cut goes under .tic, never inside the model's folder
    run_dir.mkdir()
    (run_dir / "tic.yaml").write_text(f"model: {{path: {model_dir}, dtype: {dtype}}}\n" + SMALL_LADDER)
    monkeypatch.chdir(run_dir)
    hf._MODELS.clear()
    return GateContext(load_config(run_dir / "tic.yaml"))


def assert_c2_parts_at(ctx, where: str) -> None:
    """C2 fails, and its fidelity check names a module whose path holds `where` as the first to part."""
    from tic.gates import get
    from tic.skill.runner import run_gate

    res = run_gate(get("C2"), ctx)
    assert res.verdict == "fail", res.reason
    assert where in res.details["fidelity"]["first_parting_module"], res.details["fidelity"]


def assert_climbs(ctx, gates: str = "C0 C2 C3 C4 C5 C6 C7"):
    """Each gate passes, in order; the last one's result. The generated models are dropped afterwards."""
    from tic.gates import get
    from tic.harness.engines import hf
    from tic.skill.runner import run_gate

    try:
        for gate in gates.split():
            res = run_gate(get(gate), ctx)
            assert res.verdict == "pass", (gate, res.reason)
        return res
    finally:
        hf._MODELS.clear()


def wide_llama_config(initializer_range: float, layers: int):
    """A small Llama (no q/k norm) whose weights are drawn wide: its attention is sharp, and in bf16 one rounding
    step carries far, the stock model's own forward and gradients included (C2's layer-by-layer re-check and C7's
    stock yardstick are in use on it)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING["llama"](vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=initializer_range,
                                   tie_word_embeddings=False)
