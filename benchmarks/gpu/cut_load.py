"""Cut models of several families and check that each cut loads and generates in vLLM (issue 14, H200).

  python benchmarks/gpu/cut_load.py OUTDIR [NAME ...]

For each architecture: a source model of 8 layers built from its config with seeded random weights (bf16),
`tic cut` (auto layers) into OUTDIR/cut/NAME, which runs C2's checks itself and, with vLLM and a GPU here, loads
the cut in vLLM and generates (engines_checked then lists vllm). Prints one table row per architecture and
writes OUTDIR/cut-load.json. Dimensions are the smallest the vLLM kernels of each family accept comfortably.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
            dtype="bfloat16", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MAMBA2 = dict(mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=256,
              mamba_d_conv=4, mamba_expand=2)
ARCHS = {
    "qwen3_dense": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1, norm_topk_prob=True),
    "bamba_hybrid": dict(BASE, model_type="bamba", architectures=["BambaForCausalLM"], attn_layer_indices=[3, 6],
                         **MAMBA2),
    "jamba_hybrid": dict(BASE, model_type="jamba", architectures=["JambaForCausalLM"], num_experts=4,
                         num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                         expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=32),
    "qwen3_next_hybrid": dict(BASE, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                              linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                              linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=256, shared_expert_intermediate_size=256, decoder_sparse_step=1,
                              full_attention_interval=4, head_dim=128, partial_rotary_factor=0.25),
}


def generate(name: str, out: Path):
    """The source model (in this thread: transformers' lazy imports are not thread-safe)."""
    from tic.harness.model.generate import generate_model

    src = out / "src" / name
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(ARCHS[name]))
    try:
        return generate_model(src, seed=0, out_dir=out / "full" / name)
    except Exception as e:  # noqa: BLE001 - reported per architecture
        return f"generate: {type(e).__name__}: {str(e)[:200]}"


def one(name: str, full, out: Path) -> dict:
    if isinstance(full, str):
        return {"arch": name, "rc": None, "error": full}
    t0 = time.time()
    cut = out / "cut" / name
    r = subprocess.run([sys.executable, "-m", "tic.skill.cli", "cut", str(full), str(cut), "--json"],
                       capture_output=True, text=True, timeout=900)
    rec = {}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                pass
            break
    if not rec:
        try:
            rec = json.loads(r.stdout[r.stdout.index("{"):])
        except ValueError:
            rec = {}
    check = rec.get("check", {})
    return {"arch": name, "rc": r.returncode, "layers": rec.get("layers") or rec.get("kept_layers"),
            "engines_checked": check.get("engines_checked"), "problems": check.get("problems"),
            "seconds": round(time.time() - t0, 1), "stderr_tail": r.stderr.strip().splitlines()[-3:]}


def main() -> int:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(ARCHS)
    out.mkdir(parents=True, exist_ok=True)
    fulls = {n: generate(n, out) for n in names}
    with ThreadPoolExecutor(max_workers=3) as pool:  # vllm_load takes 0.1 of the GPU per load
        rows = list(pool.map(lambda n: one(n, fulls[n], out), names))
    (out / "cut-load.json").write_text(json.dumps(rows, indent=1, default=str))
    print("| arch | tic cut exit | kept layers | engines checked | problems |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r.get('rc')} | {r.get('layers')} | {r.get('engines_checked')} | "
              f"{r.get('problems') or r.get('error') or ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
