"""Block-FP8 weights: the deployment rule, checkpoints written by it, and reading them back.

The rule is vLLM's `vllm.utils.deep_gemm.per_block_cast_to_fp8` (DeepGEMM's, which DeepSeek-style block-FP8
checkpoints follow): per block_n x block_k tile of the weight, amax = max |w| in float32 clamped to 1e-4, scale
= amax / 448, codes = float8_e4m3fn(w * (1 / scale)) (round to nearest even; |w / scale| <= 448 by
construction). The scale is what checkpoints store as `weight_scale_inv` (the dequantization multiplier,
[ceil(N / block_n), ceil(K / block_k)] float32).

A block-FP8 checkpoint is laid out as Qwen3-*-FP8 ships one: every projection weight float8_e4m3fn with its
`weight_scale_inv` beside it (MoE experts one pair per expert, in the checkpoint's per-expert names), the
embedding, lm_head, norms and router gates unquantized, and config.json's quantization_config
{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [bn, bk]}: the keys vLLM's
Fp8Config and transformers' FineGrainedFP8Config read. Which weights are quantized is read back from the
scales present, as vLLM's loader does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tic.core.errors import TicInputError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_SUFFIX = ".weight_scale_inv"
# modules a block-FP8 checkpoint leaves unquantized (by the last part of the name); config.json names the linear
# ones in modules_to_not_convert (block_fp8_config), else vLLM would build them as FP8 layers
UNQUANTIZED = ("embed_tokens", "lm_head", "gate", "router")


def ceil_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or above each scale: UE8M0 scales (an exponent alone), as vLLM's DeepGEMM path rounds
    them (`_ceil_to_ue8m0`)."""
    return torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int],
                           ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]) of a 2-D weight by the deployment rule;
    a 3-D weight [E, N, K] (MoE experts) is quantized per expert. ue8m0: each scale rounded up to a power of two
    first (vLLM's `requant_weight_ue8m0_inplace` where its DeepGEMM path takes UE8M0 scales)."""
    if w.dim() == 3:
        pairs = [quantize_weight_blocks(e, block, ue8m0) for e in w]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    bn, bk = block
    n, k = w.shape
    padded = w.new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    tiles = padded.view(-1, bn, padded.shape[1] // bk, bk)
    amax = tiles.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = ceil_to_ue8m0(scale)
    codes = (tiles * (1.0 / scale)).to(torch.float8_e4m3fn)
    return codes.view_as(padded)[:n, :k].contiguous(), scale.view(tiles.shape[0], tiles.shape[2])


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                             dtype: torch.dtype) -> torch.Tensor:
    """codes * scale per tile, in float32, then cast to dtype (the master weights a trainer starts from)."""
    bn, bk = block
    s = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return (q.float() * s[..., :q.shape[-2], :q.shape[-1]]).to(dtype)


def quantization_of(cfg: dict) -> dict:
    """config.json's quantization_config, at the top or in the text stack of a wrapper; {} when there is none."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        for key in ("text_config", "language_config", "llm_config"):
            if isinstance(cfg.get(key), dict) and isinstance(cfg[key].get("quantization_config"), dict):
                q = cfg[key]["quantization_config"]
    return q if isinstance(q, dict) else {}


def block_size_of(cfg: dict) -> tuple[int, int] | None:
    """weight_block_size of a block-FP8 quantization_config (config.json dict, text stack or wrapper); None for
    anything else."""
    q = quantization_of(cfg)
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        return None
    bn, bk = q["weight_block_size"]
    return int(bn), int(bk)


def check_block_size(block) -> tuple[int, int]:
    """A square block of positive ints: vLLM quantizes activations in groups of block_n but its GEMM reads them in
    groups of block_k, so only square blocks run the same arithmetic on every path."""
    bn, bk = (int(x) for x in block)
    if bn <= 0 or bn != bk:
        raise TicInputError(f"weight_block_size {list(block)}: block-FP8 needs a square block of positive size")
    return bn, bk


def _quantized(name: str, t: torch.Tensor) -> bool:
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return name.endswith(".weight") and t.dim() == 2 and t.is_floating_point() and module not in UNQUANTIZED


def _check_divisible(name: str, t: torch.Tensor, block: tuple[int, int]) -> None:
    n, k = t.shape
    if n % block[0] or k % block[1]:
        raise TicInputError(f"{name} [{n}, {k}] is not a whole number of {block[0]}x{block[1]} blocks (vLLM's "
                            "block-FP8 layers refuse it); choose sizes divisible by weight_block_size")


def block_fp8_config(block: tuple[int, int] = (128, 128), unquantized=()) -> dict:
    """config.json's quantization_config of a block-FP8 checkpoint, as Qwen3-*-FP8 spell it. unquantized: the full
    names of the linear modules left in the model dtype (lm_head, each layer's router gate), which vLLM and
    transformers otherwise build as FP8 layers (vLLM matches the whole name, so every layer is listed)."""
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if unquantized:
        q["modules_to_not_convert"] = sorted(unquantized)
    return q


def unquantized_linears(names) -> list[str]:
    """The module names, among checkpoint weight names, of the 2-D weights the deployment rule leaves unquantized
    that a model builds as linear layers (router gates, lm_head; not the embedding)."""
    mods = (n[: -len(".weight")] for n in names if n.endswith(".weight"))
    return sorted(m for m in mods if m.rsplit(".", 1)[-1] in UNQUANTIZED and m.rsplit(".", 1)[-1] != "embed_tokens")


def write_block_fp8(model_dir: Path, out_dir: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A block-FP8 checkpoint of the model in model_dir (its weights are the master weights), quantized by the
    deployment rule, into out_dir (files that are not weights copied as they are)."""
    from safetensors.torch import load_file, save_file

    block = check_block_size(block)
    cfg = json.loads((model_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, kept = {}, []
    for f in sorted(model_dir.glob("*.safetensors")):
        sd = load_file(f)
        out = {}
        for name, t in sd.items():
            if not _quantized(name, t):
                out[name] = t
                kept += [name] if t.dim() == 2 and t.is_floating_point() else []
                continue
            _check_divisible(name, t, block)
            out[name], out[name[: -len(".weight")] + SCALE_SUFFIX] = quantize_weight_blocks(t, block)
        save_file(out, out_dir / f.name, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    if (model_dir / "model.safetensors.index.json").is_file():  # the scales are new names: a fresh index
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for p in model_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(p, out_dir / p.name)
    cfg["quantization_config"] = block_fp8_config(block, unquantized_linears(kept))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def read_block_fp8(model_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint name of each quantized weight ('...q_proj.weight') -> (codes, scales), as stored (a weight and
    its scales may sit in different shards)."""
    from safetensors import safe_open

    where = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            where.update({k: f for k in st.keys()})

    def get(key):
        with safe_open(str(where[key]), "pt") as st:
            return st.get_tensor(key)

    return {sk[: -len(SCALE_SUFFIX)] + ".weight": (get(sk[: -len(SCALE_SUFFIX)] + ".weight"), get(sk))
            for sk in sorted(where) if sk.endswith(SCALE_SUFFIX) and sk[: -len(SCALE_SUFFIX)] + ".weight" in where}
