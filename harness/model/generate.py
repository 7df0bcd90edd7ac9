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


# config.json fields that count or size something: a negative (or, for these, zero) value is a broken config
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")


def _check_sizes(cfg: dict, path: Path, where: str = "") -> None:
    """Counts (num_*) and sizes (*_size) must be non-negative integers; the core sizes positive."""
    for key, val in cfg.items():
        if isinstance(val, dict) and key.endswith("_config") and key != "quantization_config":
            _check_sizes(val, path, f"{where}{key}.")
            continue
        if not (key.startswith("num_") or key.endswith("_size")) or val is None or isinstance(val, dict):
            continue
        if isinstance(val, list):  # per-layer counts (e.g. heads per layer)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in val):
                raise TicInputError(f"{path}: {where}{key} must be non-negative integers, got {json.dumps(val)}")
            continue
        if isinstance(val, bool) or not isinstance(val, int):
            raise TicInputError(f"{path}: {where}{key} must be an integer, got {json.dumps(val)}")
        if val < 0 or (key in POSITIVE_FIELDS and val == 0):
            raise TicInputError(f"{path}: {where}{key} must be {'positive' if key in POSITIVE_FIELDS else 'non-negative'}, "
                                f"got {val}")


def _check_head_groups(cfg: dict, path: Path, where: str = "") -> None:
    """Grouped-query attention shares each key/value head among num_attention_heads / num_key_value_heads query
    heads: a count that does not divide builds, then fails inside the first attention (a mid-gate error)."""
    for key, val in cfg.items():
        if isinstance(val, dict) and key.endswith("_config"):
            _check_head_groups(val, path, f"{where}{key}.")
    q, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(q, int) and isinstance(kv, int) and not isinstance(q, bool) and kv > 0 and q % kv:
        raise TicInputError(f"{path}: {where}num_attention_heads {q} is not a multiple of num_key_value_heads {kv} "
                            "(each key/value head serves a whole group of query heads)")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _infinity_only(name: str) -> float:
    """Infinity where a config holds it: transformers 4 wrote a Mamba-2 config's time_step_limit (0, inf) as a bare
    Infinity, so checkpoints saved then carry it (transformers 5 writes {"__float__": "Infinity"}). NaN is no
    setting a model can mean."""
    if name == "NaN":
        _reject_constant(name)
    return float(name)


def _check_activations(cfg: dict, path: Path, where: str = "") -> None:
    """Activation names (hidden_act, hidden_activation, ...) must be ones transformers implements: an unknown one
    fails only when the model is built, after records were written."""
    for key, val in cfg.items():
        if isinstance(val, dict) and key.endswith("_config"):
            _check_activations(val, path, f"{where}{key}.")
        elif key in ("hidden_act", "hidden_activation") and val is not None:
            from transformers.activations import ACT2CLS

            if not isinstance(val, str) or val not in ACT2CLS:
                raise TicInputError(f"{path}: {where}{key} {json.dumps(val)} is not an activation transformers "
                                    f"knows ({', '.join(sorted(ACT2CLS)[:6])}, ...)")


def read_model_config(model_dir: Path) -> dict:
    """config.json parsed and checked: UTF-8 JSON object, a model_type transformers knows (or remote code via
    auto_map), counts and sizes non-negative integers."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise TicInputError(f"model directory has no config.json: {model_dir}")
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_infinity_only)
    except UnicodeDecodeError as e:
        raise TicInputError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise TicInputError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, as is NaN
        raise TicInputError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise TicInputError(f"{path}: no model_type")
    mt = cfg["model_type"]
    if not isinstance(mt, str):
        raise TicInputError(f"{path}: model_type must be a string, got {json.dumps(mt)}")
    if "auto_map" not in cfg:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if mt not in CONFIG_MAPPING_NAMES:
            import transformers

            raise TicInputError(f"{path}: model_type {mt!r} is not one transformers {transformers.__version__} "
                                "knows (and config.json has no auto_map for remote code)")
    _check_sizes(cfg, path)
    _check_head_groups(cfg, path)
    _check_activations(cfg, path)
    return cfg


def check_loadable_config(model_dir: Path) -> None:
    """transformers' own checks of config.json (field types, consistency), without loading any weight."""
    cfg = read_model_config(model_dir)
    if "auto_map" in cfg:
        return  # remote code: its config class is not ours to run here
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - whatever transformers refuses, the config is the cause
        raise TicInputError(f"{Path(model_dir) / 'config.json'}: transformers refuses it: {_one_line(e, 300)}") \
            from None


def generated_dir(config_dir: Path, seed: int, init_std: float | None = None, quantization=None) -> Path:
    """Where generate_model caches the weights of config_dir/config.json drawn from `seed` (generated or not).
    quantization: None, or (method, weight block size) of the checkpoint written from them."""
    import torch

    raw = (config_dir / "config.json").read_bytes()
    quant = "" if quantization is None else f"|quant={quantization[0]}:{list(quantization[1])}"
    key = hashlib.sha256(raw + f"|seed={seed}|std={init_std}|torch={torch.__version__}{quant}".encode()).hexdigest()
    return cache_root() / "models" / key[:16]


def generate_model(config_dir: Path, seed: int, init_std: float | None = None, out_dir: Path | None = None,
                   quantization: tuple[str, tuple[int, int]] | None = None) -> Path:
    """Build the model of config_dir/config.json with weights drawn from `seed`; save as safetensors.
    quantization ("fp8", block): a block-FP8 checkpoint quantized from those weights by the deployment rule
    (tic.harness.model.quantize), the unquantized model cached beside it."""
    out_dir = out_dir or generated_dir(config_dir, seed, init_std, quantization)
    if has_weights(out_dir):
        return out_dir
    if quantization is not None:
        from tic.harness.model.quantize import write_block_fp8

        master = generate_model(config_dir, seed, init_std)
        return _publish(out_dir, lambda tmp: write_block_fp8(master, tmp, tuple(quantization[1])))
    return _publish(out_dir, lambda tmp: _build_model(config_dir, seed, init_std).save_pretrained(
        tmp, safe_serialization=True))


def _build_model(config_dir: Path, seed: int, init_std: float | None):
    import torch
    from transformers import AutoConfig

    from tic.harness.model.layer_structure import model_from_config

    read_model_config(config_dir)
    config = AutoConfig.from_pretrained(config_dir)
    if init_std is not None:
        config.initializer_range = init_std
    dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):  # sizes left to transformers' defaults can mean billions of parameters
        shape_only = model_from_config(config, dtype=torch.float32)
    need = sum(p.numel() for p in shape_only.parameters()) * 4
    _check_checkpoint_writable(shape_only, config_dir)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory // 2:
        raise TicInputError(f"{config_dir / 'config.json'}: generating its weights takes {need / 2**30:.1f} GiB "
                            f"(float32), more than half of this machine's {memory / 2**30:.1f} GiB; state the model's "
                            "sizes (hidden_size, num_hidden_layers, vocab_size, ...) in config.json")
    torch.manual_seed(seed)
    return model_from_config(config, dtype=torch.float32).to(dtype)


def _check_checkpoint_writable(model, config_dir: Path) -> None:
    """save_pretrained writes the checkpoint through transformers' weight conversions for the model type, reverted.
    One that cannot take the tensors this config builds (e.g. an embedding padded to a vocabulary smaller than
    itself) fails there; here it is found on the meta-device model, before any weight is drawn."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: nothing to revert
        return
    try:
        revert_weight_conversion(model, model.state_dict())
    except Exception as e:  # noqa: BLE001 - whatever the conversion refuses, this config is what it was given
        raise TicInputError(f"{config_dir / 'config.json'}: transformers cannot write a checkpoint of the "
                            f"{type(model).__name__} it builds from it (its weight conversion fails: "
                            f"{_one_line(e, 200)})") from None


def _one_line(e: Exception, limit: int) -> str:
    """transformers' exception as one line of a refusal: its type, then its message with the whitespace folded."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:limit]}"


def _publish(out_dir: Path, write) -> Path:
    """write(tmp) fills a fresh folder beside out_dir, which then becomes out_dir by one rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=out_dir.parent))
    try:
        write(tmp)
        if out_dir.exists() and not has_weights(out_dir):
            # a leftover without weights (a finished model only ever arrives by rename)
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # another generator finished first with the same bytes: keep its directory, which readers may be
            # loading right now (replacing it would pull files from under them)
            if not has_weights(out_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(cfg, generate: bool = True) -> Path | None:
    """The directory engines load: the configured one, or its generated-weights cache (generate=False: None when
    those weights are not generated yet, and nothing is written)."""
    model_dir = cfg.resolve(cfg.model.path)
    if not model_dir.is_dir():
        raise TicInputError(f"model directory not found: {model_dir}")
    if has_weights(model_dir):
        return model_dir
    if cfg.model.generate is None:
        raise TicInputError(f"no *.safetensors in {model_dir} (add 'generate: {{seed: 0}}' to build random weights)")
    gen = cfg.model.generate
    quant = None if gen.quantization is None else (gen.quantization, tuple(gen.weight_block_size))
    if not generate:
        cached = generated_dir(model_dir, gen.seed, gen.init_std, quant)
        return cached if has_weights(cached) else None
    return generate_model(model_dir, gen.seed, gen.init_std, quantization=quant)


def model_hash(model_dir: Path) -> str:
    """Content hash of config.json and the weight files (see tic.core.content_hash for files of 1 GiB and more)."""
    from tic.core.content_hash import files_hash

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    return files_hash([model_dir / "config.json"] + ([index] if index.is_file() else [])
                      + sorted(model_dir.glob("*.safetensors")))
