"""Is the rotary table tic's training forward reads the one vLLM's model holds? vLLM builds get_rope's cos|sin
table on the GPU while it loads a model; the same arithmetic on the CPU differs in the last bits of some angles
(a position near a zero of sin then moves by a few bf16 ulps).

  python benchmarks/gpu/rope_table_probe.py MODEL_DIR [MODEL_DIR ...]

For each model's config.json: the table get_rope builds on the CPU and under the GPU as default device, and the
one tic's vLLM kernel provider returns, compared bit for bit in the model's dtype. Exits 1 when the provider's
table is not the GPU-built one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from tic.harness.kernels.coverage import rotary_modules
    from tic.harness.kernels.vllm_provider import VLLMProvider, _table_as_vllm_builds_it, _vllm_config_for_custom_ops

    provider = VLLMProvider()
    bad = 0
    for d in argv:
        raw = json.loads((Path(d) / "config.json").read_text())
        cfg = AutoConfig.for_model(**raw).get_text_config()
        dtype = getattr(torch, raw.get("dtype", "bfloat16"))
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta}
        layer_type = None
        if "rope_type" not in params:  # one table per layer type (Gemma-3): the first one
            layer_type, params = next(iter(params.items()))
        with _vllm_config_for_custom_ops():
            rope = get_rope(head, max_position=cfg.max_position_embeddings, rope_parameters=dict(params),
                            dtype=dtype)
        cpu = _table_as_vllm_builds_it(rope, torch.device("cpu"), dtype)
        gpu = _table_as_vllm_builds_it(rope, torch.device("cuda"), dtype)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))  # on the CPU, as tic loads one
        rotary = rotary_modules(model)[0][1].to("cuda")
        ours = provider.cos_sin_cache(rotary, cfg, cfg.max_position_embeddings, dtype, torch.device("cuda"),
                                      *((layer_type,) if layer_type else ()))
        cpu_vs_gpu = int((cpu.cuda() != gpu).sum())
        ours_vs_gpu = int((ours[: gpu.shape[0]] != gpu).sum()) if ours.shape == gpu.shape else -1
        bad += ours_vs_gpu > 0  # -1: another width (a partial rotary), the provider then reads the HF table
        print(f"{Path(d).name + (f' ({layer_type})' if layer_type else ''):<14} table {tuple(gpu.shape)}: CPU-built vs GPU-built {cpu_vs_gpu} elements differ; "
              f"tic's provider vs GPU-built {ours_vs_gpu} ({provider.rope_source})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
