"""Each decoder layer's structure, read from the model itself.

A config.json dict is built into its transformers model on the `meta` device (no weights, no memory, a few
milliseconds for a small config), and every decoder layer's module tree (class names, scalar settings such as
a sliding window or an expert count, parameter and buffer names and shapes) becomes one comparable record.
Two layers with equal records are built the same way; this is what a cut chooses layers from and what proves
a cut config right, whatever the family.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass

from tic.core.errors import TicInputError
from tic.harness.model.inventory import LAYER_LISTS

# keys under which a multimodal wrapper nests its language model's config
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# attributes that name the layer's position, not how it is built
_POSITION_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "training"})
# settings shown in a layer's short label (the full record decides equality)
_LABEL_ATTRS = ("attention_type", "layer_type", "sliding_window", "is_sliding", "num_experts", "n_routed_experts")


# --- where the text stack's config lives -------------------------------------------------------------------
def text_config_key(cfg: dict) -> str | None:
    """The key holding the language model's config in a multimodal wrapper; None when cfg is the text stack."""
    for key in TEXT_CONFIG_KEYS:
        if isinstance(cfg.get(key), dict):
            return key
    return None


def text_config(cfg: dict) -> dict:
    key = text_config_key(cfg)
    return cfg[key] if key else cfg


def with_text_config(cfg: dict, text: dict) -> dict:
    key = text_config_key(cfg)
    return {**cfg, key: text} if key else text


# --- building on meta ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_transformers():
    """transformers warns about tiny or odd configs at every build; a cut builds many candidates."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    root = logging.getLogger("transformers")
    old = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        root.setLevel(old)


def model_classes():
    """Auto classes tried in order: a causal LM, then an image-text-to-text wrapper."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (AutoModelForCausalLM, AutoModelForImageTextToText)


def auto_class_for(config):
    """The first Auto class that knows this config's model type (the one loaders should use too)."""
    for auto in model_classes():
        if type(config) in auto._model_mapping:  # noqa: SLF001 - the documented registry of Auto classes
            return auto
    raise TicInputError(f"transformers has no causal-LM or image-text-to-text model for "
                        f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r})")


def parse_config(cfg: dict):
    """The transformers config object of a config.json dict."""
    from transformers import CONFIG_MAPPING

    if "model_type" not in cfg:
        raise TicInputError("config.json: no model_type")
    if cfg["model_type"] not in CONFIG_MAPPING:
        raise TicInputError(f"config.json: transformers does not know model_type {cfg['model_type']!r}")
    with quiet_transformers():
        try:  # as from_pretrained reads config.json: special floats ('Infinity') decoded, then from_dict
            cls = CONFIG_MAPPING[cfg["model_type"]]
            return cls.from_dict(cls._decode_special_floats(json.loads(json.dumps(cfg))))  # noqa: SLF001
        except Exception as e:  # noqa: BLE001 - a config transformers refuses is bad input
            raise TicInputError(f"transformers refuses this config ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200]})") from None


def build_meta(cfg: dict):
    """The model of a config.json dict on the meta device (structure only)."""
    import torch

    with torch.device("meta"):
        return model_from_config(parse_config(cfg))


def model_from_config(config, **kwargs):
    """auto_class_for(config).from_config(config, **kwargs); a config its own model class cannot build (a size
    left as None, a padding id outside the vocabulary) is the user's input: one line, exit 2."""
    with quiet_transformers():
        try:
            return auto_class_for(config).from_config(config, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the model class raises on this config
            raise TicInputError(f"transformers cannot build {type(config).__name__} from this config "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


def decoder_path(model, n: int) -> str:
    """Module path of the decoder layers: the ModuleList of length n named as transformers names a decoder's
    layers (inventory.LAYER_LISTS: `layers`, GPT-2's `h`), inside the model's decoder (get_decoder) when the model
    has one, so that a vision encoder's layers are never taken for it."""
    import torch

    roots = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            dec = get_decoder()
            if isinstance(dec, torch.nn.Module):
                roots.append(next((name for name, m in model.named_modules() if m is dec), None))
    roots.append("")
    for root in roots:
        if root is None:
            continue
        found = [name for name, m in model.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == n and name.split(".")[-1] in LAYER_LISTS
                 and (not root or name.startswith(root + "."))]
        if len(found) == 1:
            return found[0]
    others = [name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    held = f" (its {n} layers are in {', '.join(others)})" if others else ""
    raise TicInputError(f"cannot tell the decoder layers of {type(model).__name__}: no single ModuleList "
                        f"named {' or '.join(LAYER_LISTS)} of length {n}{held}; tic cuts and wraps decoders whose "
                        f"layers are a ModuleList of one of those names")


def num_text_layers(config) -> int:
    n = getattr(config.get_text_config(), "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise TicInputError("config.json: the text model declares no num_hidden_layers")
    return n


# --- one layer's record ---------------------------------------------------------------------------------------
def layer_structure(layer) -> tuple:
    """(modules, parameters, buffers): per module its relative name, class and scalar settings (position attrs
    left out); per parameter/buffer its name and shape."""
    mods = []
    for name, mod in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(mod).items()
                             if not k.startswith("_") and k not in _POSITION_ATTRS
                             and isinstance(v, (int, float, str, bool, type(None)))))
        mods.append((name, type(mod).__name__, attrs))
    params = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
    buffers = tuple((name, tuple(b.shape)) for name, b in layer.named_buffers())
    return tuple(mods), params, buffers


def outside_structure(model, path: str) -> tuple:
    """Parameter names and shapes outside the decoder layers (embeddings, norms, head, vision tower)."""
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters()
                 if not name.startswith(path + "."))


def label(structure: tuple) -> str:
    """Short human description: each direct child's class, with its telling settings."""
    mods, _, _ = structure
    parts = []
    for name, cls, attrs in mods:
        if name == "" or "." in name or cls.endswith("Norm"):  # norms: in the record, not worth a label
            continue
        shown = [f"{k}={v}" for k, v in attrs if k in _LABEL_ATTRS and v not in (None, False)]
        inner = [f"{k}={v}" for n2, _, a2 in mods if n2.startswith(name + ".") for k, v in a2
                 if k in _LABEL_ATTRS and v not in (None, False)]
        extra = sorted(set(shown + inner))
        parts.append(f"{name}={cls}" + (f"({', '.join(extra)})" if extra else ""))
    root_cls = next((cls for name, cls, _ in mods if name == ""), "?")
    return f"{root_cls}[{' '.join(parts)}]"


def digest(structure: tuple) -> str:
    return hashlib.sha256(repr(structure).encode()).hexdigest()[:10]


def first_difference(a: tuple, b: tuple) -> str:
    """Where two layer records first differ, in words (a: the cut's, b: the source's)."""
    for what, xa, xb in (("module", a[0], b[0]), ("parameter", a[1], b[1]), ("buffer", a[2], b[2])):
        for ea, eb in zip(xa, xb):
            if ea != eb:
                if what == "module":
                    if ea[:2] != eb[:2]:
                        return f"{ea[0] or 'layer'} is {ea[1]}, source {eb[0] or 'layer'} is {eb[1]}"
                    da, db = dict(ea[2]), dict(eb[2])
                    keys = [k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
                    return f"{ea[0] or 'layer'} ({ea[1]}): " + ", ".join(
                        f"{k}={da.get(k)!r} vs source {db.get(k)!r}" for k in keys[:3])
                return f"{what} {ea[0]} {list(ea[1])} vs source {eb[0]} {list(eb[1])}"
        if len(xa) != len(xb):
            extra = (xa if len(xa) > len(xb) else xb)[min(len(xa), len(xb))]
            return f"{what} {extra[0] or 'layer'} only in the {'cut' if len(xa) > len(xb) else 'source'}"
    return "records differ"


@dataclass
class ModelStructure:
    """Per-layer records of one config, and where its decoder layers live."""
    layers: list[tuple]
    outside: tuple
    path: str

    @property
    def n(self) -> int:
        return len(self.layers)


def model_structure(cfg: dict) -> ModelStructure:
    model = build_meta(cfg)
    n = num_text_layers(model.config)
    path = decoder_path(model, n)
    stack = model.get_submodule(path)
    return ModelStructure([layer_structure(layer) for layer in stack], outside_structure(model, path), path)


def loaded_layers(model):
    """The decoder ModuleList of a loaded model."""
    return model.get_submodule(decoder_path(model, num_text_layers(model.config)))
