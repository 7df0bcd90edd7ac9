"""Write the configs that measure the bundled vLLM patches, each with and without them (same GPU run).

  python benchmarks/gpu/patch_matrix.py            # writes p-<model>-<mode>-<off|on>.yaml beside itself

Models: dense (hidden 256, head_dim 64), moe (Qwen3-MoE, hidden 256), big (hidden 2048, head_dim 128).
Modes: eager (enforce_eager), graph (torch.compile + CUDA graphs, vLLM's default), chunk (eager, chunked
prefill in chunks of 64 tokens). Workload: 48 requests, prompts 16-280 tokens, 48 sampled tokens (sequences
reach 328 tokens), C3 batches of 2, 16 and 48.
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PATCHES = ["fa3-fixed-tile", "rmsnorm-fixed-block", "gemm-fixed-m"]
MODELS = ("dense", "moe", "big")
MODES = {
    "eager": {"enforce_eager": True},
    "graph": {"enforce_eager": False},
    "chunk": {"enforce_eager": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64,
              "max_num_seqs": 48},
}


def config(model: str, mode: str, patched: bool) -> dict:
    name = f"p-{model}-{mode}-{'on' if patched else 'off'}"
    options = {"batch_invariant": False, **MODES[mode], "gpu_memory_utilization": 0.05,
               "kv_cache_memory_bytes": 536870912, "max_model_len": 512, "seed": 0, "model_runner": "v1",
               "record": f"records/{name}-vllm.jsonl"}
    return {
        "model": {"path": model, "dtype": "bfloat16", "generate": {"seed": 0}},
        "rollout": {"engine": "vllm", "batch_size": 48, "options": options,
                    "patches": PATCHES if patched else []},
        "train": {"engine": "hf", "device": "cuda", "attn_implementation": "sdpa", "micro_batch_size": 4},
        "prompts": {"source": "random", "count": 48, "seed": 0, "min_len": 16, "max_len": 280},
        "sampling": {"temperature": 1.0, "max_tokens": 48, "seed": 0},
        "layouts": {"batch_sizes": [2, 16, 48], "positions": ["first", "last"], "probes": 2},
        "state_dir": f"state/{name}",
    }


# Ablation: one config per patch subset, so each patch is credited with the gate it flips (same GPU run as
# its unpatched twin). "bi" = vLLM's own batch-invariant mode (VLLM_BATCH_INVARIANT=1) under the patches.
ABLATION = {
    "a-dense-eager-none": ("dense", "eager", False, []),
    "a-dense-eager-fa3": ("dense", "eager", False, ["fa3-fixed-tile"]),
    "a-big-eager-none": ("big", "eager", False, []),
    "a-big-eager-fa3": ("big", "eager", False, ["fa3-fixed-tile"]),
    "a-big-eager-gemm": ("big", "eager", False, ["gemm-fixed-m"]),
    "a-big-eager-fa3-gemm": ("big", "eager", False, ["fa3-fixed-tile", "gemm-fixed-m"]),
    "a-big-bi-fa3": ("big", "eager", True, ["fa3-fixed-tile"]),
    "a-big-bi-fa3-rms": ("big", "eager", True, ["fa3-fixed-tile", "rmsnorm-fixed-block"]),
}


def ablation_config(name: str) -> dict:
    model, mode, bi, subset = ABLATION[name]
    c = config(model, mode, False)
    c["rollout"]["patches"] = subset
    c["rollout"]["options"]["batch_invariant"] = bi
    c["rollout"]["options"]["record"] = f"records/{name}-vllm.jsonl"
    c["state_dir"] = f"state/{name}"
    return c


# Training side on vLLM's kernels (issue 10): the patched eager rollout against a training forward that runs
# the same kernels through tic's autograd wrappers; C5 (recompute = rollout) and C6 (training layouts).
def train_config(model: str) -> dict:
    name = f"t-{model}-eager"
    c = config(model, "eager", True)
    c["rollout"]["options"]["record"] = f"records/{name}-vllm.jsonl"
    c["train"] = {"engine": "hf", "device": "cuda", "kernels": "vllm", "micro_batch_size": 4}
    c["state_dir"] = f"state/{name}"
    return c


# The whole ladder C0-C10 (issue 15): baseline measured and frozen first (drive.py --baseline-by), C8/C9 with
# in-place weight sync, C10 with each side's engine core in a process of its own. "graph": CUDA graphs of the
# decode steps without torch.compile (vLLM then runs its eager kernels, the ones the training side calls).
LADDER_MODES = {
    "eager": {"enforce_eager": True},
    "graph": {"enforce_eager": False, "compilation_config": {"mode": 0}, "cudagraph_mode": "FULL_DECODE_ONLY"},
}


def ladder_config(model: str, mode: str) -> dict:
    name = f"l-{model}-{mode}"
    c = train_config(model)
    c["rollout"]["options"] = {k: v for k, v in c["rollout"]["options"].items() if k != "enforce_eager"}
    c["rollout"]["options"].update(LADDER_MODES[mode])
    c["rollout"]["options"]["record"] = f"records/{name}-vllm.jsonl"
    c["perf"] = {"requests": 48, "input_len": 128, "output_len": 64, "concurrency": 48, "warmup": 1, "repeats": 3,
                 "floor": 0.7}
    c["training"] = {"updates": 2, "lr": 1e-3}
    c["scale_up"] = [{"name": "deeper", "config": {"num_hidden_layers": 8}},
                     {"name": "longer context", "config": {"num_hidden_layers": 8}, "prompt_len": 400,
                      "max_tokens": 64}]
    c["state_dir"] = f"state/{name}"
    return c


def names(models=MODELS, modes=tuple(MODES)) -> list[str]:
    return [f"p-{m}-{mode}-{s}" for m in models for mode in modes for s in ("off", "on")]


if __name__ == "__main__":
    for m in MODELS:
        for mode in MODES:
            for patched in (False, True):
                c = config(m, mode, patched)
                name = c["state_dir"].split("/")[-1]
                (HERE / f"{name}.yaml").write_text(
                    f"# Generated by patch_matrix.py: {m} model, {mode} mode, bundled patches "
                    f"{'on' if patched else 'off'}.\n" + yaml.safe_dump(c, sort_keys=False, width=120))
    for name in ABLATION:
        (HERE / f"{name}.yaml").write_text(f"# Generated by patch_matrix.py: ablation {name}.\n"
                                           + yaml.safe_dump(ablation_config(name), sort_keys=False, width=120))
    for m in MODELS:
        (HERE / f"t-{m}-eager.yaml").write_text(f"# Generated by patch_matrix.py: {m} model, patched eager rollout, "
                                                "training on vLLM's kernels.\n"
                                                + yaml.safe_dump(train_config(m), sort_keys=False, width=120))
    for m in ("dense", "moe"):
        for mode in LADDER_MODES:
            (HERE / f"l-{m}-{mode}.yaml").write_text(f"# Generated by patch_matrix.py: the whole ladder, {m} model, "
                                                     f"{mode} rollout.\n" + yaml.safe_dump(
                                                         ladder_config(m, mode), sort_keys=False, width=120))
    print(" ".join(names() + list(ABLATION) + [f"t-{m}-eager" for m in MODELS]))
