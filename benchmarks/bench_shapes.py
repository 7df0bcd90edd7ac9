"""Shapes and inputs the examples do not use: the ladder on small generated models of odd sizes, long prompts.

    .venv/bin/python benchmarks/bench_shapes.py [CASE ...] [--dtype float32|bfloat16] [--gates C0,...,C7]

Each case (CASES: a transformers model type and the sizes that make it unlike the examples: one KV head, head
sizes 16 and 80, an odd vocabulary, a sliding window shorter than the prompts, a fused qkv, a latent attention
with a grouped router) gets a config.json from transformers' config class, weights generated from seed 0, and
the ladder from C0 with `kernels: consistent` on prompts of 30 to 140 tokens (16 sampled), in a fresh process and
folder (qwen3-long-prompts: 700 to 1,400). Prints one row per case: each gate's verdict, then the first
non-passing gate's reason.
"""

from __future__ import annotations

import argparse

from bench_architectures import ladder_row, row_cells  # a sibling script: run from the repository root

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
MLA = dict(SMALL, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16)
CASES = {
    "llama-one-kv-head": ("llama", dict(SMALL, vocab_size=1000, hidden_size=96, intermediate_size=200,
                                        num_attention_heads=3, num_key_value_heads=1, head_dim=32)),
    "qwen2-head-80": ("qwen2", dict(SMALL, vocab_size=777, hidden_size=160, intermediate_size=320,
                                    num_attention_heads=2, num_key_value_heads=1)),
    "qwen3-head-16": ("qwen3", dict(SMALL, hidden_size=80, intermediate_size=144, num_attention_heads=5,
                                    num_key_value_heads=5, head_dim=16)),
    "mistral-window-16": ("mistral", dict(SMALL, sliding_window=16)),
    "gemma2-window-16": ("gemma2", dict(SMALL, num_hidden_layers=4, head_dim=16, sliding_window=16)),
    "qwen3-moe": ("qwen3_moe", dict(SMALL, moe_intermediate_size=48, head_dim=16, num_experts=8,
                                    num_experts_per_tok=2)),
    "phi3-fused": ("phi3", dict(SMALL, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)),
    "deepseek-v2-greedy": ("deepseek_v2", dict(MLA, q_lora_rank=None)),
    "deepseek-v2-groups": ("deepseek_v2", dict(MLA, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                                               topk_group=2, routed_scaling_factor=2.0)),
    "qwen3-long-prompts": ("qwen3", dict(SMALL, head_dim=16)),
}
PROMPTS = "{source: random, count: 5, seed: 3, min_len: 30, max_len: 140}"
PROMPTS_OF = {"qwen3-long-prompts": "{source: random, count: 3, seed: 3, min_len: 700, max_len: 1400}"}
TIC_YAML = """model: {path: ., dtype: DTYPE, generate: {seed: 0}}
rollout: {engine: hf, kernels: consistent, batch_size: 4}
train: {engine: hf, kernels: consistent, micro_batch_size: 3, padding_side: right}
prompts: PROMPTS
sampling: {temperature: 1.0, max_tokens: 16, seed: 1}
layouts: {batch_sizes: [2, 5], positions: [first, last], probes: 2}
locate: {enabled: false}
"""


def config_for(case: str, dtype: str) -> dict:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, sizes = CASES[case]
    cfg = AutoConfig.for_model(model_type, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, **sizes).to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    cfg["dtype"] = dtype
    return cfg


def run(case: str, gates: list[str], dtype: str) -> dict:
    tic_yaml = TIC_YAML.replace("DTYPE", dtype).replace("PROMPTS", PROMPTS_OF.get(case, PROMPTS))
    return ladder_row(config_for(case, dtype), tic_yaml, gates, f"tic-shape-{case}-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES), metavar="CASE", help=", ".join(CASES))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--gates", default="C0,C1,C2,C3,C4,C5,C6,C7", help="C1 waits: no baseline is run here")
    ap.add_argument("--width", type=int, default=150, help="characters of the reason column")
    args = ap.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}; the cases: {', '.join(CASES)}")
    gates = args.gates.split(",")
    print(f"{'case':<22} {'dtype':<9} {'exit':>4} " + " ".join(f"{g:>5}" for g in gates) + "  first reason")
    for case in args.cases:
        r = run(case, gates, args.dtype)
        print(f"{case:<22} {args.dtype:<9} {r['exit']:>4} {row_cells(r, gates)}  {r['reason'][:args.width]}",
              flush=True)


if __name__ == "__main__":
    main()
