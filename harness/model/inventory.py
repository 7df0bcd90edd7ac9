"""C0 inventory: operator classes, dtypes and quantization per layer, from config.json and safetensors headers.

No weight is loaded: a safetensors file starts with an 8-byte length and a JSON header naming every tensor's
dtype and shape, which is all the inventory needs.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from pathlib import Path

from tic.harness.model.families import family, int_field, layer_kinds
from tic.core.errors import TicInputError

# The names transformers gives a decoder's ModuleList of layers: `layers` (Llama, Qwen, Mistral, ...), `h` (GPT-2,
# GPT-J, Bloom, Falcon, CodeGen, GPT-BigCode)
LAYER_LISTS = ("layers", "h")
LAYER_LIST = "(?:" + "|".join(LAYER_LISTS) + ")"  # a regex fragment: one of those names
LAYER_RE = re.compile(r"(?:^|\.)" + LAYER_LIST + r"\.(\d+)\.(.+)$")
# bits per element of each dtype the safetensors format defines (safetensors' Dtype enum)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "F64": 64, "I64": 64, "U64": 64}
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale", "weight_zero_point",
                  "qweight", "scales", "qzeros")


def read_safetensors_header(path: Path, with_size: bool = False):
    """The tensor entries of a safetensors header; with_size=True also returns where the data starts."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise TicInputError(f"{path}: truncated safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise TicInputError(f"{path}: implausible safetensors header size {n}")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TicInputError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise TicInputError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path, name, info)
    return (header, 8 + n) if with_size else header


def _check_entry(path: Path, name: str, info) -> None:
    """One header entry: {dtype: str, shape: [int >= 0], data_offsets: [start, end]} (the safetensors format)."""
    def ints(v):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    if not isinstance(info, dict):
        raise TicInputError(f"{path}: tensor {name!r}: header entry is not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise TicInputError(f"{path}: tensor {name!r}: header entry lacks {key}")
    if not isinstance(info["dtype"], str):
        raise TicInputError(f"{path}: tensor {name!r}: dtype is not a string")
    if not ints(info["shape"]):
        raise TicInputError(f"{path}: tensor {name!r}: shape is not a list of non-negative integers")
    if not ints(info["data_offsets"]) or len(info["data_offsets"]) != 2:
        raise TicInputError(f"{path}: tensor {name!r}: data_offsets is not [start, end]")
    bits = DTYPE_BITS.get(info["dtype"])
    if bits is None:
        raise TicInputError(f"{path}: tensor {name!r}: unknown dtype {info['dtype']!r}")
    s, e = info["data_offsets"]
    n = 1
    for d in info["shape"]:
        n *= d
    if n * bits != 8 * (e - s):
        raise TicInputError(f"{path}: tensor {name!r}: shape {info['shape']} of {info['dtype']} needs "
                            f"{n * bits / 8:g} bytes but data_offsets span {e - s}")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model: those the index names, or every *.safetensors without an index."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
            raise TicInputError(f"{index}: malformed index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) and f and Path(f).name == f for f in wm.values()):
            raise TicInputError(f"{index}: weight_map must map tensor names to shard file names in the model directory")
        files = sorted({model_dir / f for f in wm.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        if not f.is_file():
            raise TicInputError(f"missing weight shard: {f}")
    return files


def tensor_locations(model_dir: Path) -> dict[str, dict]:
    """name -> {dtype, shape, path, start, end}: absolute byte range of each tensor's data in its shard."""
    out = {}
    for f in weight_files(model_dir):
        header, data_start = read_safetensors_header(f, with_size=True)
        size = f.stat().st_size
        for name, info in header.items():
            s, e = info["data_offsets"]
            if not (0 <= s <= e and data_start + e <= size):
                raise TicInputError(f"{f}: tensor {name} lies outside the file")
            if name in out:
                raise TicInputError(f"tensor {name} appears in two shards ({out[name]['path'].name}, {f.name})")
            out[name] = {"dtype": info["dtype"], "shape": info["shape"], "path": f,
                         "start": data_start + s, "end": data_start + e}
    return out


def tensor_table(model_dir: Path) -> dict[str, dict]:
    """name -> {dtype, shape, file}, via model.safetensors.index.json when present."""
    return {name: {"dtype": t["dtype"], "shape": t["shape"], "file": t["path"].name}
            for name, t in tensor_locations(model_dir).items()}


def layer_tensors(table: dict) -> dict[int, dict[str, dict]]:
    """Decoder layer index -> {name inside the layer: tensor info}, for comparing layers across models."""
    out: dict[int, dict[str, dict]] = defaultdict(dict)
    for name, info in table.items():
        m = LAYER_RE.search(name)
        if m:
            out[int(m.group(1))][m.group(2)] = info
    return dict(out)


def _tensor_kinds(names: list[str]) -> dict:
    """What tensor names say about a layer."""
    kinds = {}
    joined = " ".join(names)
    if ".experts." in joined or joined.startswith("experts.") or "block_sparse_moe" in joined:
        kinds["mlp"] = "moe"
    if "mixer.A_log" in joined or ".A_log" in joined:
        kinds["attention"] = "mamba2" if "mixer" in joined else "linear"
    if "kv_a_proj" in joined or "q_a_proj" in joined:
        kinds["attention"] = "mla"
    return kinds


def _layer_index(name: str, layer_prefix: str | None) -> int | None:
    """Decoder layer of a tensor name: any 'layers.N.' (or 'h.N.') by default; with layer_prefix (the layer list's
    path and a dot, 'model.layers.') only '<layer_prefix>N.' (so that a vision tower's layers are not taken for
    decoder layers)."""
    if layer_prefix is not None:
        m = re.match(r"(\d+)\.", name[len(layer_prefix):]) if name.startswith(layer_prefix) else None
        return int(m.group(1)) if m else None
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def build_manifest(model_dir: Path, config: dict, layer_prefix: str | None = None) -> dict:
    table = tensor_table(model_dir) if any(Path(model_dir).glob("*.safetensors")) else {}
    kinds = layer_kinds(config)
    per_layer: dict[int, list[str]] = defaultdict(list)
    for name in table:
        i = _layer_index(name, layer_prefix)
        if i is not None:
            per_layer[i].append(name)
    layers = []
    for i, k in enumerate(kinds):
        names = sorted(per_layer.get(i, []))
        k = {**k, **_tensor_kinds(names)}
        dtypes = sorted({table[n]["dtype"] for n in names})
        quant = sorted({n.rsplit(".", 1)[-1] for n in names if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES})
        classes = []
        if k.get("attention"):
            classes.append(f"attention:{k['attention']}")
        if k.get("mlp"):
            classes.append(f"mlp:{k['mlp']}")
        classes += [f"dtype:{d}" for d in dtypes] + [f"quant:{q}" for q in quant]
        layers.append({"index": i, "attention": k.get("attention"), "mlp": k.get("mlp"), "dtypes": dtypes,
                       "quant_tensors": quant, "tensors": len(names), "classes": classes})
    fam = family(config.get("model_type", ""))
    label = lambda L: f"{L['attention']}/{L['mlp']}"  # noqa: E731
    transitions = sorted({(label(a), label(b)) for a, b in zip(layers, layers[1:]) if label(a) != label(b)})
    extra_layer_keys = [n for n in table if _layer_index(n, layer_prefix) is None]
    return {
        "model_type": config.get("model_type"),
        "family_known": fam is not None,
        "num_layers": len(layers),
        "layers": layers,
        "operator_classes": sorted({c for L in layers for c in L["classes"]} | set(fam.extra_classes if fam else ())
                                   | {f"norm:{fam.norm if fam else 'unknown'}"}),
        "transitions": [list(t) for t in transitions],
        "dtypes": sorted({t["dtype"] for t in table.values()}),
        "quantization_config": config.get("quantization_config"),
        "mtp_layers": int_field(config, "num_nextn_predict_layers"),
        "non_layer_tensors": sorted(extra_layer_keys),
        "weights_read": bool(table),
    }
