"""Architectures tic was not written for: the ladder on tiny random models of transformers' own model types.

    .venv/bin/python benchmarks/bench_architectures.py [MODEL_TYPE ... | --all] [--gates C0,C2,C3,C4,C5,C6,C7]
        [--dtype float32|bfloat16]

For each model type (default: ARCHITECTURES; --all: every type transformers maps to a causal LM), a config.json
from transformers' config class with small sizes (SIZES; the type's own defaults for everything else), weights
generated from seed 0, and the ladder from C0 with `kernels: consistent` on both sides, each in a fresh process
and folder. Prints one row per model type: each gate's verdict, then the first non-passing gate's reason, or C0's
refusal. What a row should read: C0 refuses what the wrappers do not implement, naming the module and what is
missing; anything C0 lets through passes C2-C7, or C2's fidelity check names the first module where the wrapped
model parts from the stock one. An `error` verdict or exit 3 is a defect.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# decoder-only model types of transformers 5, none of them an example of tic's or named by an issue
ARCHITECTURES = ("seed_oss", "ernie4_5", "smollm3", "exaone4", "olmo3", "cohere2", "gemma", "qwen2", "mixtral",
                 "qwen3_moe", "doge", "diffllama", "arcee", "apertus", "bitnet", "glm4", "persimmon", "opt",
                 "gpt2", "falcon", "bloom", "gptj", "codegen", "granitemoe", "phimoe", "ernie4_5_moe", "glm4_moe",
                 "deepseek_v3", "llama4_text", "jetmoe", "gpt_bigcode", "gpt_oss", "vaultgemma", "lfm2")
TIC_YAML = """model: {path: ., dtype: DTYPE, generate: {seed: 0}}
rollout: {engine: hf, kernels: consistent, batch_size: 8}
train: {engine: hf, kernels: consistent, micro_batch_size: 4, padding_side: right}
prompts: {source: random, count: 6, seed: 0, min_len: 4, max_len: 20}
sampling: {temperature: 1.0, max_tokens: 12, seed: 0}
layouts: {batch_sizes: [2, 5], positions: [first, last], probes: 2}
locate: {enabled: false}
"""


def config_for(model_type: str, dtype: str) -> dict:
    """transformers' config of this type with SIZES where the type has such fields, as config.json holds it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = AutoConfig.for_model(model_type, **SIZES).to_dict()
    if cfg.get("kv_lora_rank"):  # a latent attention expands its keys per head: as many KV heads as heads
        cfg = AutoConfig.for_model(model_type, **{**SIZES, "num_key_value_heads": SIZES["num_attention_heads"]}
                                   ).to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")]
    cfg["dtype"] = dtype
    return cfg


def ladder_row(config: dict, tic_yaml: str, gates: list[str], prefix: str) -> dict:
    """The ladder from gates[0] to gates[-1] (--keep-going) on a model generated from `config` under `tic_yaml`,
    in a fresh process and temporary folder (its generated weights there too, not in the user's model cache):
    exit code, each gate's result, and the first gate's reason that neither passes nor waits."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        (Path(d) / "tic.yaml").write_text(tic_yaml)
        p = subprocess.run([sys.executable, "-m", "tic.skill.cli", "ladder", "-c", "tic.yaml", "--from", gates[0],
                            "--to", gates[-1], "--keep-going", "--json"], cwd=d, capture_output=True, text=True,
                           env={**os.environ, "NO_COLOR": "1", "TIC_CACHE": str(Path(d) / "cache")},
                           timeout=1800)
    try:
        results = {r["gate"]: r for r in json.loads(p.stdout)["results"]}
    except (json.JSONDecodeError, KeyError):
        line = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"exit": p.returncode, "results": {}, "reason": line}
    bad = next((results[g] for g in gates if g in results and results[g]["verdict"] not in ("pass", "waiting")),
               None)
    return {"exit": p.returncode, "results": results, "reason": bad["reason"] if bad else ""}


def row_cells(row: dict, gates: list[str]) -> str:
    return " ".join(f"{row['results'].get(g, {}).get('verdict', '-')[:5]:>5}" for g in gates)


def run(model_type: str, gates: list[str], dtype: str) -> dict:
    try:
        cfg = config_for(model_type, dtype)
    except Exception as e:  # noqa: BLE001 - a type whose config class refuses these sizes is a row, not a stop
        reason = f"transformers' config: {type(e).__name__}: {e}".replace("\n", " ")
        return {"exit": "-", "results": {}, "reason": reason}
    return ladder_row(cfg, TIC_YAML.replace("DTYPE", dtype), gates, f"tic-arch-{model_type}-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_types", nargs="*", default=list(ARCHITECTURES))
    ap.add_argument("--all", action="store_true", help="every model type transformers maps to a causal LM")
    ap.add_argument("--gates", default="C0,C2,C3,C4,C5,C6,C7")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the weights' and the ladder's dtype (config.json's dtype and tic.yaml's model.dtype)")
    ap.add_argument("--width", type=int, default=150, help="characters of the reason column")
    args = ap.parse_args()
    gates = args.gates.split(",")
    if args.all:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        args.model_types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    print(f"{'model_type':<24} {'exit':>4} " + " ".join(f"{g:>5}" for g in gates) + "  first reason")
    for mt in args.model_types:
        r = run(mt, gates, args.dtype)
        print(f"{mt:<24} {r['exit']:>4} {row_cells(r, gates)}  {r['reason'][:args.width]}", flush=True)


if __name__ == "__main__":
    main()
