"""Rollout throughput on the GPU, one run: default vLLM, vLLM's batch-invariant mode, and vLLM with tic's
bundled patches (enabled the way an RL job enables them: TIC_PATCHES, loaded by vLLM's plugin entry point).

  python benchmarks/bench_vllm_patches.py [--out FILE.json]

Workload (issue 9): a Qwen3-1.7B-like model with random weights (28 layers, hidden 2048, head_dim 128,
bf16), 256 requests x 128 prompt tokens -> 256 generated tokens each, CUDA graphs on, in-process engines,
each variant in a fresh process. Prints tokens/s per variant (best of the timed rounds) and the ratio to
default. Needs one GPU and vLLM 0.26 (tic installed so that vLLM finds its plugin). The default and batch-invariant
variants run vLLM's own defaults (torch.compile, FULL_AND_PIECEWISE graphs); the patched one runs the consistent
rollout as benchmarks/gpu/rollout_throughput.py does: its patch list and the compiled mode C0 accepts
(benchmarks/gpu/configs.py). For full-depth shapes, both workloads and profiles, use that script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from configs import MODES, PATCHES as TIC_PATCHES  # noqa: E402

PATCHES = ",".join(TIC_PATCHES)
# (label, environment, LLM options)
VARIANTS = [("default", {"VLLM_BATCH_INVARIANT": "0", "TIC_PATCHES": ""}, {}),
            ("batch_invariant", {"VLLM_BATCH_INVARIANT": "1", "TIC_PATCHES": ""}, {}),
            ("tic_patches", {"VLLM_BATCH_INVARIANT": "0", "TIC_PATCHES": PATCHES}, MODES["compiled"])]
MODEL_DIR = "/tmp/tic-bench-qwen3-1p7b"


def make_model(d: str) -> None:
    if os.path.exists(os.path.join(d, "config.json")):
        return
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(d)


def child(out: str, rounds: int, options: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tic import patches

    t0 = time.time()
    llm = LLM(model=MODEL_DIR, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.5,
              max_model_len=1024, seed=0, **options)
    load_s = time.time() - t0
    wanted = patches.parse_names(os.environ.get("TIC_PATCHES"))
    active = patches.active()
    if sorted(active) != sorted(wanted):
        raise SystemExit(f"patches requested {wanted} but active {active}")
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 150000, (128,), generator=g).tolist())
               for _ in range(256)]
    sp = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True, detokenize=False, seed=1)
    llm.generate(prompts[:16], sp)  # warm-up
    runs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.time()
        outs = llm.generate(prompts, sp)
        torch.cuda.synchronize()
        dt = time.time() - t0
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    with open(out, "w") as f:
        json.dump({"load_s": load_s, "tok_s_runs": runs, "tok_s": max(runs), "active_patches": active}, f)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
        return 0
    out_path = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    rounds = int(os.environ.get("BENCH_ROUNDS", "2"))
    make_model(MODEL_DIR)
    res = {}
    order = os.environ.get("BENCH_ORDER")  # e.g. the reverse order, to see what running first or last costs
    variants = [next(v for v in VARIANTS if v[0] == n) for n in order.split(",")] if order else VARIANTS
    for label, env, options in variants:
        out = f"/tmp/bench-{label}.json"
        e = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
        p = subprocess.run([sys.executable, __file__, "child", out, str(rounds), json.dumps(options)], env=e,
                           capture_output=True, text=True, timeout=int(os.environ.get("BENCH_CHILD_TIMEOUT", "240")))
        if p.returncode:
            print(f"{label}: FAILED\n{p.stderr[-1500:]}", flush=True)
            continue
        res[label] = json.load(open(out))
        print(label, json.dumps(res[label]), flush=True)
    base = res.get("default", {}).get("tok_s")
    print(f"\n{'variant':<16} {'tok/s':>9} {'% of default':>13}  rounds")
    for k, v in res.items():
        pct = f"{100 * v['tok_s'] / base:12.1f}%" if base else "-"
        print(f"{k:<16} {v['tok_s']:9.0f} {pct:>13}  {', '.join(f'{x:.0f}' for x in v['tok_s_runs'])}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if len(res) == len(VARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
