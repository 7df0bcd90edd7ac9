"""C2's checks on a cut: loads, covers the full model's operator classes, keeps each layer's tensors, and each
kept layer computes bit for bit what its source layer computes on the same hidden states."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tic.config.schema import CutConfig
from tic.harness.model.cut import (CUT_RECORD, cut_model, cut_settings, decoder_prefix, decoder_tensors, is_tic_cut,
                                   layer_keys, layer_signatures)
from tic.harness.model.generate import read_model_config
from tic.harness.model.quantize import block_size_of, quantization_of
from tic.harness.model.inventory import LAYER_RE, build_manifest, tensor_locations, tensor_table
from tic.harness.model.layer_structure import (ModelStructure, auto_class_for, first_difference, layer_structure,
                                               loaded_layers, model_structure, text_config)
from tic.harness.model.vllm_load import vllm_available, vllm_generates
from tic.core.errors import TicInputError

FIDELITY_BATCH = 2
FIDELITY_MIN_LEN = 24


# --- loading ---------------------------------------------------------------------------------------------
def load_hf(model_dir: Path):
    """(model, loading problems) with transformers; an exception becomes a problem, not a crash."""
    import torch
    from transformers import AutoConfig

    try:
        auto = auto_class_for(AutoConfig.from_pretrained(model_dir))
        model, info = auto.from_pretrained(model_dir, dtype="auto", output_loading_info=True,
                                           **dequantized(model_dir))
    except Exception as e:  # noqa: BLE001 - any loader error means "does not load"
        return None, [f"does not load with transformers: {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    model.eval()
    model.requires_grad_(False)
    torch.manual_seed(0)
    return model, info


def dequantized(model_dir: Path) -> dict:
    """from_pretrained's arguments that load a block-FP8 checkpoint dequantized (codes * scales per block, in the
    model dtype), as C2's reference wants it; on CUDA transformers' FP8 layers would also need the `kernels`
    package from the hub. {} for any other checkpoint."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    block = block_size_of(cfg)
    if block is None:
        return {}
    from transformers import FineGrainedFP8Config

    keep = quantization_of(cfg).get("modules_to_not_convert")
    return {"quantization_config": FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=keep,
                                                        dequantize=True)}


def decoder_layers(model, n: int):
    """The ModuleList of decoder layers (the language model's, never a vision tower's)."""
    layers = loaded_layers(model)
    if len(layers) != n:
        raise TicInputError(f"{type(model).__name__} has {len(layers)} decoder layers, expected {n}")
    return layers


def _relative_keys(keys) -> set[str]:
    out = set()
    for k in keys:
        m = LAYER_RE.search(k)
        out.add(f"layers.*.{m.group(2)}" if m else k)
    return out


def module_signature(layer) -> tuple:
    """How a layer is built (tic.harness.model.layer_structure): a layer built from a stale config (e.g. full
    attention where the source slides a window) differs here even when outputs agree."""
    return layer_structure(layer)


# --- fidelity --------------------------------------------------------------------------------------------
def _outputs(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return [getattr(out, "last_hidden_state", out)]


def layer_fidelity(full, cut, kept: list[int], n_full: int, vocab: int, seq_len: int) -> list[dict]:
    """For each kept layer: the full model's layer input (args and kwargs as the model passed them) goes into
    the cut's layer; both outputs must be bitwise equal (torch.equal)."""
    import torch

    full_layers, cut_layers = decoder_layers(full, n_full), decoder_layers(cut, len(kept))
    captured: dict[int, dict] = {}
    hooks = []
    for i in kept:
        def pre(mod, args, kwargs, i=i):
            captured.setdefault(i, {})["in"] = (args, dict(kwargs))

        def post(mod, args, kwargs, out, i=i):
            captured[i]["out"] = [o.detach().clone() for o in _outputs(out)]
        hooks.append(full_layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(full_layers[i].register_forward_hook(post, with_kwargs=True))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (FIDELITY_BATCH, seq_len), generator=gen)
    try:
        with torch.no_grad():
            full(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for j, i in enumerate(kept):
        row = {"cut_layer": j, "source_layer": i}
        if i not in captured or "out" not in captured[i]:
            rows.append({**row, "equal": False, "why": "source layer was not reached by the forward"})
            continue
        args, kwargs = captured[i]["in"]
        with torch.no_grad():
            got = _outputs(cut_layers[j](*args, **kwargs))
        want = captured[i]["out"]
        same = len(got) == len(want) and all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                                             for a, b in zip(got, want))
        if not same:
            a, b = got[0], want[0]
            diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else None
            row["why"] = f"max |diff| {diff}" if diff is not None else f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        rows.append({**row, "equal": same})
    return rows


# --- the check -------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ModelFiles:
    """A model as its files describe it, no weight loaded: config.json, the layer structure transformers builds
    from it on meta (None when it cannot), the tensor table, the decoder layers' tensor-name prefix and their
    tensors by layer index, and C0's manifest."""

    dir: Path
    config: dict
    structure: ModelStructure | None
    table: dict[str, dict]
    prefix: str
    layers: dict[int, dict[str, dict]]
    manifest: dict


def read_pair(full_dir: Path, full_cfg: dict, cut_dir: Path, cut_cfg: dict,
              problems: list[str]) -> tuple[ModelFiles, ModelFiles]:
    """The full model and its cut from their files; a cut config transformers cannot build is a problem."""
    full_struct = model_structure(full_cfg)
    try:
        cut_struct = model_structure(cut_cfg)
    except Exception as e:  # noqa: BLE001 - a cut config transformers cannot build is a failed cut
        cut_struct = None
        problems.append(f"the cut config does not build with transformers: {str(e).splitlines()[0][:200]}")
    ft, ct = tensor_table(full_dir), tensor_table(cut_dir)
    fp = decoder_prefix(list(ft), full_struct.n, full_struct.path)
    try:
        cp = decoder_prefix(list(ct), cut_struct.n, cut_struct.path) if cut_struct else fp
    except TicInputError:
        cp = fp
    return (ModelFiles(full_dir, full_cfg, full_struct, ft, fp, decoder_tensors(ft, fp),
                       build_manifest(full_dir, text_config(full_cfg), fp)),
            ModelFiles(cut_dir, cut_cfg, cut_struct, ct, cp, decoder_tensors(ct, cp),
                       build_manifest(cut_dir, text_config(cut_cfg), cp)))


def recorded_layers(cut_dir: Path) -> tuple[dict, list[int]] | None:
    """The cut record and the source layer of each cut layer; None when the record is missing or malformed."""
    try:
        rec = json.loads((cut_dir / CUT_RECORD).read_text())
        return rec, [int(i) for i in rec["layers"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def count_problems(full: ModelFiles, cut: ModelFiles, kept: list[int]) -> tuple[list[int], list[str]]:
    """The kept layers that exist in the full model, and problems with the layer counts."""
    n_full, problems = full.structure.n, []
    if any(not 0 <= i < n_full for i in kept):
        problems.append(f"cut record names layers {kept} but the full model has {n_full}")
        kept = [i for i in kept if 0 <= i < n_full]
    n_cut = cut.structure.n if cut.structure else cut.manifest["num_layers"]
    if n_cut != len(kept):
        problems.append(f"cut config declares {n_cut} layers, cut record keeps {len(kept)}")
    return kept, problems


def missing_kinds(full: ModelFiles, cut: ModelFiles) -> tuple[list[str], list[str], list[str]]:
    """Layer kinds (structure and tensors) of the full model the cut lacks, the transitions between kinds it
    lacks, and the problem naming the first lacking kind with its source layers."""
    full_keys = layer_keys(full.structure, full.layers)
    name_of = dict(zip(full_keys, layer_signatures(full.structure, full.layers)))
    cut_keys = layer_keys(cut.structure, cut.layers) if cut.structure else []
    lacking = [k for k in dict.fromkeys(full_keys) if k not in set(cut_keys)] if cut.structure else []

    def transitions(keys: list) -> set:
        return {(a, b) for a, b in zip(keys, keys[1:]) if a != b}

    missing_tr = sorted(f"{name_of[a]} -> {name_of[b]}" for a, b in transitions(full_keys) - transitions(cut_keys))
    problem = [f"the cut lacks a layer kind of the full model: [{name_of[lacking[0]]}] (source layers "
               f"{[i for i, k in enumerate(full_keys) if k == lacking[0]]})"] if lacking else []
    return [f"kind {name_of[k]}" for k in lacking], missing_tr, problem


def layer_problems(full: ModelFiles, cut: ModelFiles, kept: list[int]) -> list[str]:
    """Each kept layer's tensors, shapes, dtypes and structure against its source layer's."""
    out = []
    for j, i in enumerate(kept):
        src, got, where = full.layers.get(i, {}), cut.layers.get(j, {}), f"cut layer {j} (source {i})"
        out += [f"{where}: tensor {name} missing" for name in sorted(set(src) - set(got))]
        out += [f"{where}: extra tensor {name}" for name in sorted(set(got) - set(src))]
        for name in sorted(set(src) & set(got)):
            a, b = src[name], got[name]
            if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
                out.append(f"{where}: {name} is {b['dtype']}{b['shape']}, source {a['dtype']}{a['shape']}")
        built, source = (cut.structure.layers[j] if cut.structure and j < cut.structure.n else None,
                         full.structure.layers[i])
        if built is not None and built != source:
            out.append(f"{where} differs from source in structure: {first_difference(built, source)} "
                       "(stale per-layer config?)")
    return out


def non_layer_problems(full: ModelFiles, cut: ModelFiles) -> list[str]:
    """Tensors outside the decoder layers (embeddings, final norm, head): present, same dtypes and shapes."""
    fn, cn = set(full.manifest["non_layer_tensors"]), set(cut.manifest["non_layer_tensors"])
    out = [f"non-layer tensor {name} missing from the cut" for name in sorted(fn - cn)
           if not name.startswith(("mtp.", "model.mtp."))]
    for name in sorted(fn & cn):
        a, b = full.table[name], cut.table[name]
        if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
            out.append(f"non-layer tensor {name}: {b['dtype']}{b['shape']} vs source {a['dtype']}{a['shape']}")
    return out


def loading_problems(full_info: dict, cut_info: dict) -> list[str]:
    """What transformers said loading the cut: weights missing, shapes mismatched, weights its model ignores."""
    out = []
    if cut_info["missing_keys"]:
        out.append(f"cut loads with missing weights (randomly initialised): {sorted(cut_info['missing_keys'])[:3]}")
    if cut_info["mismatched_keys"]:
        out.append(f"cut loads with mismatched shapes: {sorted(cut_info['mismatched_keys'])[:3]}")
    extra = _relative_keys(cut_info["unexpected_keys"]) - _relative_keys(full_info["unexpected_keys"])
    if extra:
        out.append(f"cut has weights its model ignores: {sorted(extra)[:3]}")
    return out


def loaded_fidelity(full_dir: Path, cut_dir: Path, kept: list[int], n_full: int, problems: list[str]) -> list[dict]:
    """Both models loaded with transformers: each kept layer is built like its source and computes its bits on the
    same hidden states (fidelity rows; none when the cut does not load or its layers do not line up)."""
    full, full_info = load_hf(full_dir)
    if full is None:
        raise TicInputError(f"the full model {full_dir} " + full_info[0])
    cut, cut_info = load_hf(cut_dir)
    if cut is None:
        problems.append("cut " + cut_info[0])
        return []
    problems.extend(loading_problems(full_info, cut_info))
    if not kept or problems_block_fidelity(problems):
        return []
    fl_mods, cl_mods = decoder_layers(full, n_full), decoder_layers(cut, len(kept))
    for j, i in enumerate(kept):
        a, b = module_signature(cl_mods[j]), module_signature(fl_mods[i])
        if a != b:
            problems.append(f"cut layer {j} (source {i}) is built differently: {first_difference(a, b)[:300]}")
    text = full.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    seq_len = max(FIDELITY_MIN_LEN, min(int(window) + 8, 512)) if isinstance(window, int) else FIDELITY_MIN_LEN
    rows = layer_fidelity(full, cut, kept, n_full, text.vocab_size, seq_len)
    problems.extend(f"cut layer {r['cut_layer']} (source {r['source_layer']}) is not bitwise equal to its source on "
                    f"the same hidden states ({r['why']})" for r in rows if not r["equal"])
    return rows


def engines_checked(cut_dir: Path, problems: list[str]) -> list[str]:
    """The rollout engine loads the cut and generates, where vLLM and a GPU are there (only a cut with no problem)."""
    if problems or not vllm_available():
        return ["hf"]
    why = vllm_generates(cut_dir)
    if why:
        problems.append(f"the cut does not load and generate in vLLM: {why}")
    return ["hf", "vllm"]


def check_cut(full_dir: Path, cut_dir: Path) -> dict:
    """Every C2 measurement on a full model and its cut; problems is empty only when the cut is faithful."""
    full_dir, cut_dir = Path(full_dir), Path(cut_dir)
    full_cfg, cut_cfg = read_model_config(full_dir), read_model_config(cut_dir)
    recorded = recorded_layers(cut_dir)
    if recorded is None:
        return {"problems": [f"{cut_dir / CUT_RECORD}: missing or malformed cut record; the source of each layer "
                             "is unknown"], "layers": [], "fidelity": [], "full_classes": [], "missing_classes": []}
    rec, kept = recorded
    problems: list[str] = []
    full, cut = read_pair(full_dir, full_cfg, cut_dir, cut_cfg, problems)
    kept, counts = count_problems(full, cut, kept)
    problems += counts
    # 1. coverage: operator classes (C0 manifest) and every layer kind the full model builds
    missing = sorted(set(full.manifest["operator_classes"]) - set(cut.manifest["operator_classes"]))
    if missing:
        problems.append(f"cut manifest lacks operator classes of the full model: {', '.join(missing)}")
    kinds, missing_tr, kind_problem = missing_kinds(full, cut)
    # 2. per-layer tensors, shapes, dtypes and structure; the lacking kind after them, which usually say why;
    # every kept tensor's bytes equal the source's (a cut of another version of the model fails here)
    problems += layer_problems(full, cut, kept) + kind_problem + non_layer_problems(full, cut)
    problems += differing_bytes(full_dir, cut_dir, kept, full.prefix, cut.prefix)
    # 3. loads; 4. fidelity; 5. the rollout engine loads and generates
    rows = loaded_fidelity(full_dir, cut_dir, kept, full.structure.n, problems)
    engines = engines_checked(cut_dir, problems)
    return {"problems": problems, "layers": kept, "fidelity": rows, "full_classes": full.manifest["operator_classes"],
            "missing_classes": missing + kinds, "missing_transitions": missing_tr, "full_layers": full.structure.n,
            "explanation": rec.get("explanation", []), "notes": rec.get("notes", []), "engines_checked": engines}


def _same_bytes(a: dict, b: dict, chunk: int = 16 << 20) -> bool:
    if a["end"] - a["start"] != b["end"] - b["start"]:
        return False
    with open(a["path"], "rb") as fa, open(b["path"], "rb") as fb:
        fa.seek(a["start"])
        fb.seek(b["start"])
        left = a["end"] - a["start"]
        while left:
            n = min(chunk, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def differing_bytes(full_dir: Path, cut_dir: Path, kept: list[int], full_prefix: str, cut_prefix: str) -> list[str]:
    """Problems for kept tensors (decoder layers and the rest) whose bytes differ from the source tensor's."""
    floc, cloc = tensor_locations(full_dir), tensor_locations(cut_dir)
    fl, cl = decoder_tensors(floc, full_prefix), decoder_tensors(cloc, cut_prefix)
    out = []
    for j, i in enumerate(kept):
        src, got = fl.get(i, {}), cl.get(j, {})
        out += [f"cut layer {j} (source {i}): {name} bytes differ from the source"
                for name in sorted(set(src) & set(got)) if not _same_bytes(src[name], got[name])]
    in_layers = ({f"{full_prefix}{i}.{r}" for i, t in fl.items() for r in t}
                 | {f"{cut_prefix}{j}.{r}" for j, t in cl.items() for r in t})
    out += [f"tensor {name}: bytes differ from the source (cut from another version of the model?)"
            for name in sorted((set(floc) & set(cloc)) - in_layers) if not _same_bytes(floc[name], cloc[name])]
    return out


def problems_block_fidelity(problems: list[str]) -> bool:
    """Fidelity needs each cut layer to be the right module; a layer-count mismatch makes that meaningless."""
    return any(p.startswith("cut config declares") or p.startswith("cut record names") for p in problems)


@dataclass(frozen=True)
class CutRequest:
    """The cut C2 checks: its directory and how it is cut. named_by_user: tic.yaml's cut.out, where a cut that
    does not match is refused, never rebuilt (tic's own, under the state directory, is rebuilt when stale)."""

    out: Path
    layers: str | list[int] = "auto"
    max_layers: int = 6
    named_by_user: bool = False

    @classmethod
    def from_config(cls, section: CutConfig | None, resolve: Callable[[Path], Path], own_out: Path) -> "CutRequest":
        """tic.yaml's cut: section (resolve: its paths -> files); own_out: where tic keeps its own cut."""
        if section is None:
            return cls(own_out)
        if section.out is None:
            return cls(own_out, section.layers, section.max_layers)
        return cls(resolve(section.out), section.layers, section.max_layers, named_by_user=True)


def must_build(req: CutRequest, model_dir: Path, model_hash: str) -> bool:
    """Whether the cut under test must be (re)built. A tic cut is reused only if it was cut from the model as it is
    now (content hash, recorded when C2 made it) with the requested settings; otherwise it is rebuilt.
    Everything the build would read is checked here, and nothing is written, so a bad cut setting stops a run
    before its first write."""
    out, full = req.out, Path(model_dir)
    want = cut_settings(req.layers, req.max_layers)
    if is_tic_cut(out):
        rec = json.loads((out / CUT_RECORD).read_bytes())
        same_source = rec.get("source") == str(full.resolve())
        if req.named_by_user and not same_source:
            raise TicInputError(f"cut.out {out} was cut from {rec.get('source')}, not from the configured "
                                f"model {full}")
        if req.named_by_user and rec.get("settings") != want:
            raise TicInputError(f"cut.out {out} was cut with {rec.get('settings')}, tic.yaml asks for {want}; "
                                "rerun `tic cut -c tic.yaml` or make cut: match the cut")
        # A cut made by `tic cut` records no source hash: C2 compares its bytes with the source instead.
        fresh = rec.get("source_hash") == model_hash or (req.named_by_user and rec.get("source_hash") is None)
        if same_source and rec.get("settings") == want and fresh:
            cut_model(full, out, layers=req.layers, max_layers=req.max_layers, dry_run=True)  # settings still valid
            return False
    elif req.named_by_user and out.is_dir() and any(out.iterdir()):
        return False  # a cut without record: checked, and failed for it
    cut_model(full, out, layers=req.layers, max_layers=req.max_layers, dry_run=True)
    return True


def cut_dir_for(req: CutRequest, model_dir: Path, model_hash: str) -> Path:
    """The cut under test, (re)built when absent or stale."""
    if must_build(req, model_dir, model_hash):
        cut_model(model_dir, req.out, layers=req.layers, max_layers=req.max_layers, source_hash=model_hash)
    return req.out
