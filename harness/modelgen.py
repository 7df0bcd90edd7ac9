"""Models built from a config.json with seeded random weights (no hub), cached by content hash."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tic.core.errors import TicInputError


def cache_root() -> Path:
    return Path(os.environ.get("TIC_CACHE", Path.home() / ".cache" / "tic"))


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors"))


def read_model_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise TicInputError(f"model directory has no config.json: {model_dir}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TicInputError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise TicInputError(f"{path}: no model_type")
    return cfg


def generate_model(config_dir: Path, seed: int, init_std: float | None = None, out_dir: Path | None = None) -> Path:
    """Build the model of config_dir/config.json with weights drawn from `seed`; save as safetensors."""
    import torch
    from transformers import AutoConfig

    from tic.harness.layer_structure import auto_class_for

    raw = (config_dir / "config.json").read_bytes()
    key = hashlib.sha256(raw + f"|seed={seed}|std={init_std}|torch={torch.__version__}".encode()).hexdigest()[:16]
    out_dir = out_dir or cache_root() / "models" / key
    if has_weights(out_dir):
        return out_dir
    read_model_config(config_dir)
    config = AutoConfig.from_pretrained(config_dir)
    if init_std is not None:
        config.initializer_range = init_std
    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = auto_class_for(config).from_config(config, dtype=torch.float32)
    model = model.to(dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)  # concurrent generators: last rename wins, both wrote the same bytes
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def quantize_block_fp8(model_dir: Path, out_dir: Path, block: tuple[int, int] = (16, 16),
                       not_converted: tuple[str, ...] = ("lm_head",)) -> Path:
    """A block-FP8 copy of a generated model, laid out as FP8 checkpoints ship (DeepSeek-V3 style): every
    nn.Linear weight (but not_converted) stored as float8_e4m3fn with a float32 `weight_scale_inv` per
    block x block tile (the tile's max |w| / 448), and quantization_config quant_method fp8 with
    weight_block_size."""
    import torch
    from safetensors.torch import load_file, save_file

    from tic.harness.layer_structure import build_meta

    cfg = read_model_config(model_dir)
    meta = build_meta(cfg)
    linear = {name for name, m in meta.named_modules()
              if isinstance(m, torch.nn.Linear) and not any(name.split(".")[-1] == x for x in not_converted)}
    finfo = torch.finfo(torch.float8_e4m3fn)
    bo, bi = block
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sd = load_file(f)
        for name in [k for k in sd if k.endswith(".weight") and k[: -len(".weight")] in linear]:
            w = sd[name].float()
            rows, cols = w.shape
            r, c = -(-rows // bo), -(-cols // bi)
            padded = torch.zeros(r * bo, c * bi)
            padded[:rows, :cols] = w
            tiles = padded.view(r, bo, c, bi)
            scale = (tiles.abs().amax(dim=(1, 3)) / finfo.max).clamp(min=1e-12)
            q = (tiles / scale[:, None, :, None]).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
            sd[name] = q.view(r * bo, c * bi)[:rows, :cols].contiguous()
            sd[name[: -len(".weight")] + ".weight_scale_inv"] = scale.float().contiguous()
        save_file(sd, out_dir / f.name, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in sd})
    if (model_dir / "model.safetensors.index.json").is_file():  # the scales are new names: a fresh index
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for p in model_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(p, out_dir / p.name)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [bo, bi], "modules_to_not_convert": list(not_converted)}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def resolve_model_dir(cfg) -> Path:
    """The directory engines load: the configured one, or its generated-weights cache."""
    model_dir = cfg.resolve(cfg.model.path)
    if not model_dir.is_dir():
        raise TicInputError(f"model directory not found: {model_dir}")
    if has_weights(model_dir):
        return model_dir
    if cfg.model.generate is None:
        raise TicInputError(f"no *.safetensors in {model_dir} (add 'generate: {{seed: 0}}' to build random weights)")
    return generate_model(model_dir, cfg.model.generate.seed, cfg.model.generate.init_std)


def model_hash(model_dir: Path) -> str:
    """Content hash of config.json and the weight files (headers + sizes + bytes for files under 1 GiB)."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}".encode())
        with p.open("rb") as f:
            if st.st_size < (1 << 30):
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            else:
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(n))
                h.update(str(st.st_mtime_ns).encode())
    return h.hexdigest()[:16]
