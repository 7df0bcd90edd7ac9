"""Cut a small model (4-6 layers) out of a full checkpoint: choose layers, rewrite config.json, stream tensors.

Each layer's kind is read from the model itself (tic.harness.model.layer_structure: the config built on the meta
device) together with the tensors the checkpoint holds for it (dtypes, quantization scales). The choice keeps
every distinct kind and, for each transition between kinds that occurs, one adjacent pair showing it. The
config is rewritten by whichever rule reproduces the kept layers' structure, proven on meta
(tic.harness.model.cut_config). Tensors are copied byte range by byte range from the source shards (never a whole
tensor in memory), so dtypes, quantization scales and bytes are carried exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tic.harness.model.cut_config import rewrite_config
from tic.harness.model.families import Family, family
from tic.harness.model.inventory import LAYER_LIST, LAYER_RE, QUANT_SUFFIXES, tensor_locations, weight_files
from tic.harness.model.layer_structure import ModelStructure, digest, label, model_structure, text_config
from tic.core.errors import TicInputError
from tic.core.paths import is_within, real_path
from tic.core.fsio import atomic_write_text

CUT_RECORD = "cut.json"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = 4 << 30
_COPY_THREADS = int(os.environ.get("TIC_CUT_THREADS", "8"))
_COPY_CHUNK = 64 << 20
# (the layer list's path and a dot, 'model.layers.' or 'transformer.h.'; the index; the name inside the layer)
_LAYER_KEY = re.compile(r"^((?:.*?\.)?" + LAYER_LIST + r"\.)(\d+)\.(.+)$")


# --- layer choice ----------------------------------------------------------------------------------------
@dataclass
class CutPlan:
    layers: list[int]
    reasons: dict[int, list[str]] = field(default_factory=dict)
    requirements: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    auto: bool = True

    def explain(self) -> list[str]:
        lines = [f"kept layers {self.layers} ({'auto' if self.auto else 'as given'})"]
        for i in self.layers:
            lines.append(f"  layer {i}: " + ("; ".join(self.reasons.get(i, [])) or "given"))
        if self.uncovered:
            lines.append("  not covered: " + ", ".join(self.uncovered))
        return lines


def _tensor_label(tensors: dict) -> str:
    dtypes = sorted({t["dtype"] for t in tensors.values()})
    quant = sorted({n.rsplit(".", 1)[-1] for n in tensors if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES})
    return "/".join(dtypes) + (" +" + ",".join(quant) if quant else "")


def layer_keys(structure: ModelStructure, layer_tensors: dict[int, dict]) -> list[tuple]:
    """One key per layer; equal keys exactly when two layers are built alike (meta structure) and hold alike
    tensors (names, dtypes, shapes: quantized layers differ from unquantized ones). Comparable across models."""
    return [(digest(st), repr(sorted((k, t["dtype"], tuple(t["shape"])) for k, t in layer_tensors.get(i, {}).items())))
            for i, st in enumerate(structure.layers)]


def layer_signatures(structure: ModelStructure, layer_tensors: dict[int, dict]) -> list[str]:
    """layer_keys as readable strings (a short label; kinds sharing a label told apart by number)."""
    keys, labels = layer_keys(structure, layer_tensors), {}
    for i, (st, key) in enumerate(zip(structure.layers, keys)):
        labels.setdefault(key, f"{label(st)} {_tensor_label(layer_tensors.get(i, {}))}".strip())
    seen: dict[str, list] = {}
    for key, text in labels.items():  # two kinds with one label get told apart by number
        seen.setdefault(text, []).append(key)
    names = {key: text if len(seen[text]) == 1 else f"{text} #{seen[text].index(key) + 1}"
             for text in seen for key in seen[text]}
    return [names[k] for k in keys]


def _coverage(sel: set[int], sigs: list[str]) -> set[str]:
    cov = {f"kind {sigs[i]}" for i in sel}
    cov |= {f"transition {sigs[i]} -> {sigs[i + 1]}" for i in sel
            if i + 1 in sel and sigs[i] != sigs[i + 1]}
    return cov


def requirements(sigs: list[str]) -> set[str]:
    return _coverage(set(range(len(sigs))), sigs)


def _greedy(sigs: list[str], need: set[str], sel: set[int], max_layers: int) -> set[int]:
    """Add contiguous windows (best new requirements per added layer) until need is covered, then prune."""
    n = len(sigs)
    sel = set(sel)
    while not need <= _coverage(sel, sigs):
        have = _coverage(sel, sigs)
        best = None
        for length in range(1, max(1, max_layers) + 1):
            for s in range(0, n - length + 1):
                w = set(range(s, s + length))
                added = len(w - sel)
                if not added:
                    continue
                gain = len(_coverage(sel | w, sigs) - have)
                key = (gain / added, -added, -s)
                if gain and (best is None or key > best[0]):
                    best = (key, w)
        sel |= best[1]
    for i in sorted(sel, reverse=True):  # drop layers whose removal loses nothing
        if need <= _coverage(sel - {i}, sigs):
            sel.discard(i)
    return sel


def choose_layers(sigs: list[str], max_layers: int = 6, min_layers: int = 4) -> CutPlan:
    """Fewest layers covering every class and transition: the shortest single window when one does, else the
    best greedy cover seeded from each window (kept sorted; earliest wins ties)."""
    n = len(sigs)
    if n == 0:
        raise TicInputError("the model declares no layers; nothing to cut")
    need = requirements(sigs)
    sel = None
    for length in range(1, min(max_layers, n) + 1):
        for s in range(0, n - length + 1):
            if need <= _coverage(set(range(s, s + length)), sigs):
                sel = set(range(s, s + length))
                break
        if sel is not None:
            break
    if sel is None:
        seeds = [set()] + [set(range(s, s + L)) for L in range(2, max_layers + 1) for s in range(n - L + 1)
                           if any(sigs[i] != sigs[i + 1] for i in range(s, s + L - 1))]
        sel = min((_greedy(sigs, need, seed, max_layers) for seed in seeds), key=lambda c: (len(c), sorted(c)))
    plan = CutPlan(layers=[], requirements=sorted(need))
    covered: set[str] = set()
    for i in sorted(sel):
        mine = _coverage({j for j in sel if j <= i}, sigs) - covered
        covered |= mine
        plan.reasons[i] = [f"[{sigs[i]}]"] + [r for r in sorted(mine) if r.startswith("transition")]
    target = min(min_layers, n)
    while len(sel) < target:  # pad with neighbours so kept layers stay adjacent
        nxt = min(j for i in sel for j in (i + 1, i - 1) if 0 <= j < n and j not in sel)
        sel.add(nxt)
        plan.reasons[nxt] = [f"[{sigs[nxt]}]", f"padding to {target} layers (neighbour of a kept layer)"]
    if len(sel) > max_layers:
        raise TicInputError(f"covering every layer kind and transition needs {len(sel)} layers "
                            f"({sorted(sel)}), more than --max-layers {max_layers}; raise it or pass --layers")
    plan.layers = sorted(sel)
    return plan


def parse_layers(spec: str | list | None, n: int) -> list[int] | None:
    """'auto'/None -> None; '3,4,17' or [3, 4, 17] -> sorted unique indices, each checked against n."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return None
    items = spec if isinstance(spec, list) else [x for x in str(spec).split(",") if x.strip()]
    try:
        idx = [int(x) for x in items]
    except (TypeError, ValueError):
        raise TicInputError(f"--layers: expected 'auto' or comma-separated layer indices, got {spec!r}") from None
    if not idx:
        raise TicInputError("--layers: no layer given")
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise TicInputError(f"--layers: {bad} out of range; the model has layers 0..{n - 1}")
    if len(set(idx)) != len(idx):
        raise TicInputError(f"--layers: repeated layer in {idx}")
    return sorted(idx)


# --- tensors ---------------------------------------------------------------------------------------------
def _layer_prefixes(names, mtp_prefixes: tuple) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for name in names:
        m = _LAYER_KEY.match(name)
        if m and not name.startswith(mtp_prefixes):
            out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return out


def decoder_prefix(names, n: int, module_path: str, mtp_prefixes: tuple = Family().mtp_prefixes) -> str:
    """The tensor-name prefix of the decoder layers, their list's path and a dot ('model.layers.',
    'model.language_model.layers.', 'transformer.h.'): the one holding layers 0..n-1; when a vision tower's also
    does, the one matching the decoder's module path."""
    prefixes = _layer_prefixes(names, mtp_prefixes)
    cands = [p for p, idx in prefixes.items() if set(range(n)) <= idx]
    if len(cands) > 1:
        exact = [p for p in cands if p == module_path + "."]
        named = [p for p in cands if any(w in p for w in ("language_model", "text_model", "llm"))]
        cands = exact or named or cands
    if len(cands) != 1:
        raise TicInputError(f"cannot tell the decoder layers among tensor prefixes {sorted(prefixes)} "
                            f"(need exactly one holding layers 0..{n - 1})")
    return cands[0]


def decoder_tensors(table: dict, prefix: str) -> dict[int, dict[str, dict]]:
    """Decoder layer index -> {name inside the layer: tensor info}, for tensors under the decoder prefix."""
    out: dict[int, dict[str, dict]] = {}
    for name, info in table.items():
        m = _LAYER_KEY.match(name)
        if m and m.group(1) == prefix:
            out.setdefault(int(m.group(2)), {})[m.group(3)] = info
    return out


def map_tensor_names(names: list[str], kept: list[int], n: int, prefix: str,
                     mtp_prefixes: tuple = Family().mtp_prefixes) -> tuple[dict[str, str], list[str]]:
    """source name -> cut name for kept tensors (decoder layers renumbered; everything else, a vision tower's
    layers included, kept as it is), and notes on what was dropped."""
    new_index = {i: j for j, i in enumerate(kept)}
    mapping, notes, mtp = {}, [], 0
    for name in names:
        if name.startswith(mtp_prefixes):
            mtp += 1
            continue
        m = _LAYER_KEY.match(name)
        if not m or m.group(1) != prefix:
            mapping[name] = name  # embeddings, final norm, head, vision tower
            continue
        i = int(m.group(2))
        if i >= n:
            mtp += 1  # DeepSeek-style MTP layers sit after the decoder layers
        elif i in new_index:
            mapping[name] = f"{prefix}{new_index[i]}.{m.group(3)}"
    if mtp:
        notes.append(f"{mtp} MTP tensor(s) dropped")
    return mapping, notes


def _copy_range(src_fd: int, dst_fd: int, start: int, length: int, dst_start: int) -> None:
    """Copy src[start:start+length] to dst[dst_start:...] at explicit offsets (so several copies can run at
    once into one file): kernel-side where the OS offers it, bounded chunks otherwise (RSS never holds a whole
    tensor)."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        step = min(_COPY_CHUNK, length - done)
        if use_cfr:
            try:
                k = os.copy_file_range(src_fd, dst_fd, step, start + done, dst_start + done)
            except OSError:
                use_cfr = False
                continue
        else:
            buf = os.pread(src_fd, step, start + done)
            k = os.pwrite(dst_fd, buf, dst_start + done)
        if k <= 0:
            raise TicInputError(f"short read while copying tensor data (offset {start + done})")
        done += k


def _shard_plan(items: list[tuple[str, dict]], max_shard: int) -> list[list[tuple[str, dict]]]:
    shards, cur, size = [], [], 0
    for it in items:
        b = it[1]["end"] - it[1]["start"]
        if cur and size + b > max_shard:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += b
    if cur or not shards:
        shards.append(cur)
    return shards


def write_shards(out_dir: Path, renamed: list[tuple[str, dict]], max_shard: int,
                 fsync: bool = False) -> tuple[dict, int]:
    """Write (cut name, source location) tensors as safetensors shards + index; returns (weight_map, bytes)."""
    shards = _shard_plan(renamed, max_shard)
    weight_map, total, fds = {}, 0, {}
    try:
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            header, off = {"__metadata__": {"format": "pt"}}, 0
            for name, loc in shard:
                b = loc["end"] - loc["start"]
                header[name] = {"dtype": loc["dtype"], "shape": loc["shape"], "data_offsets": [off, off + b]}
                off += b
            hb = json.dumps(header, separators=(",", ":")).encode()
            hb += b" " * (-len(hb) % 8)  # data starts 8-byte aligned
            with (out_dir / fname).open("wb") as f:
                f.write(len(hb).to_bytes(8, "little"))
                f.write(hb)
                f.flush()
                base = 8 + len(hb)
                jobs = []
                for name, loc in shard:
                    src = str(loc["path"])
                    if src not in fds:
                        fds[src] = os.open(src, os.O_RDONLY)
                    jobs.append((fds[src], loc["start"], loc["end"] - loc["start"],
                                 base + header[name]["data_offsets"][0]))
                    weight_map[name] = fname
                # a few copies in flight: one waits on the disk while another moves bytes (measured in
                # benchmarks/bench_cut.py); each writes its own byte range of the shard
                with ThreadPoolExecutor(max_workers=_COPY_THREADS) as pool:
                    for fut in [pool.submit(_copy_range, s_fd, f.fileno(), a, n, d) for s_fd, a, n, d in jobs]:
                        fut.result()
                if fsync:
                    os.fsync(f.fileno())
            total += off
    finally:
        for fd in fds.values():
            os.close(fd)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2))
    return weight_map, total


# --- the cut ---------------------------------------------------------------------------------------------
def _read_config(model_dir: Path) -> dict:
    from tic.harness.model.generate import read_model_config

    return read_model_config(Path(model_dir))


def plan_cut(model_dir: Path, layers=None, max_layers: int = 6, min_layers: int = 4) -> dict:
    """Everything a cut decides, before a byte moves: kept layers and why, the proven config, the tensor
    mapping (JSON-ready, so another process can write it)."""
    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    if max_layers < 1:
        raise TicInputError(f"--max-layers must be at least 1, got {max_layers}")
    fam = family(text_config(cfg).get("model_type", "")) or Family()
    structure = model_structure(cfg)
    n = structure.n
    locs = tensor_locations(model_dir)
    prefix = decoder_prefix(list(locs), n, structure.path, fam.mtp_prefixes)
    sigs = layer_signatures(structure, decoder_tensors(locs, prefix))
    given = parse_layers(layers, n)
    if given is None:
        plan = choose_layers(sigs, max_layers, min_layers)
    else:
        need = requirements(sigs)
        plan = CutPlan(layers=given, requirements=sorted(need), auto=False,
                       uncovered=sorted(need - _coverage(set(given), sigs)))
        plan.reasons = {i: [f"[{sigs[i]}]", "given by --layers"] for i in given}
    new_cfg, notes = rewrite_config(cfg, plan.layers, structure)
    mapping, tnotes = map_tensor_names(list(locs), plan.layers, n, prefix, fam.mtp_prefixes)
    return {"source": str(model_dir.resolve()), "model_type": cfg.get("model_type"), "source_layers": n,
            "layers": plan.layers, "auto": plan.auto, "explanation": plan.explain(),
            "requirements": plan.requirements, "uncovered": plan.uncovered, "notes": notes + tnotes,
            "decoder_prefix": prefix, "config": new_cfg, "mapping": mapping}


def write_cut(model_dir: Path, out_dir: Path, plan: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD,
              fsync: bool = False) -> dict:
    """Write a planned cut into out_dir (built beside it, then renamed into place); returns the cut record.
    By default shards are left to the page cache: a torn write after a crash cannot pass unnoticed, since C2
    compares every kept tensor's layer bit for bit with its source. fsync=True makes the cut durable before
    returning, at the disk's write speed."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    locs = tensor_locations(model_dir)
    mapping = plan["mapping"]
    missing = [s for s in mapping if s not in locs]
    if missing:
        raise TicInputError(f"the cut plan names tensors the checkpoint lacks: {missing[:3]}")
    # source order (shard, offset): reads stay sequential
    renamed = [(mapping[s], locs[s]) for s in sorted(mapping, key=lambda s: (str(locs[s]["path"]), locs[s]["start"]))]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for p in model_dir.iterdir():  # tokenizer, generation config, ...: carried as they are
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json", CUT_RECORD):
                shutil.copy2(p, tmp / p.name)
        _, kept_bytes = write_shards(tmp, renamed, max_shard_bytes, fsync)
        (tmp / "config.json").write_text(json.dumps(plan["config"], indent=2))
        record = {k: v for k, v in plan.items() if k not in ("config", "mapping")}
        record.update({"tensors": len(renamed), "bytes_kept": kept_bytes,
                       "bytes_source": sum(t["end"] - t["start"] for t in locs.values()),
                       "seconds": round(time.perf_counter() - t0, 3)})
        (tmp / CUT_RECORD).write_text(json.dumps(record, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record


def is_tic_cut(d: Path) -> bool:
    """Whether d holds a cut tic wrote (its cut record names a source and the kept layers)."""
    try:
        rec = json.loads((Path(d) / CUT_RECORD).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and isinstance(rec.get("source"), str) and isinstance(rec.get("layers"), list)


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """A cut may only replace what tic made: OUT_DIR must not overlap the model directory in either direction,
    must not be a file or a link, and if it holds anything, that must be an earlier tic cut."""
    src, out = real_path(model_dir), real_path(out_dir)
    if out == src:
        raise TicInputError(f"OUT_DIR {out_dir} is the model directory; choose another")
    if is_within(out, src):
        raise TicInputError(f"OUT_DIR {out_dir} lies inside the model directory {model_dir}; choose one outside it")
    if is_within(src, out):
        raise TicInputError(f"OUT_DIR {out_dir} contains the model directory {model_dir}; choose one beside it")
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise TicInputError(f"OUT_DIR {out_dir} is a symbolic link; give the directory it points to")
    if out_dir.exists() and not out_dir.is_dir():
        raise TicInputError(f"OUT_DIR {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_tic_cut(out_dir):
        raise TicInputError(f"OUT_DIR {out_dir} is not empty and holds no earlier tic cut; choose an empty OUT_DIR")


def cut_settings(layers, max_layers: int) -> dict:
    """What a cut was asked for, in one normal form (kept in its record: a changed request means a new cut)."""
    try:
        spec = "auto" if layers is None or (isinstance(layers, str) and layers.strip().lower() == "auto") else (
            sorted(int(x) for x in (layers if isinstance(layers, list) else str(layers).split(",")) if str(x).strip()))
    except (TypeError, ValueError):
        spec = str(layers)  # not a valid request; parse_layers says why when the cut is planned
    return {"layers": spec, "max_layers": int(max_layers)}


def cut_model(model_dir: Path, out_dir: Path, layers=None, max_layers: int = 6, min_layers: int = 4,
              max_shard_bytes: int = DEFAULT_MAX_SHARD, fsync: bool = False, dry_run: bool = False,
              source_hash: str | None = None) -> dict:
    """Plan (layers, proven config, mapping) and write the cut; returns the cut record. dry_run=True checks
    everything a cut reads (config, headers, layer choice, OUT_DIR) and writes nothing. source_hash (the
    model's content hash, when the caller has it) goes into the record, so C2 can tell a cut of the model as it
    is now from one of an earlier version."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_out_dir(model_dir, out_dir)
    if not weight_files(model_dir):
        raise TicInputError(f"no weights found in {model_dir} (no *.safetensors)")
    plan = plan_cut(model_dir, layers, max_layers, min_layers)
    if dry_run:
        return {"layers": plan["layers"], "source_layers": plan["source_layers"]}
    plan.update(source_hash=source_hash, settings=cut_settings(layers, max_layers))
    plan_s = time.perf_counter() - t0
    record = write_cut(model_dir, out_dir, plan, max_shard_bytes, fsync)
    record["plan_seconds"] = round(plan_s, 3)
    record["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write_text(out_dir / CUT_RECORD, json.dumps(record, indent=2))
    return record


def read_cut_record(cut_dir: Path) -> dict:
    p = Path(cut_dir) / CUT_RECORD
    if not p.is_file():
        raise TicInputError(f"{cut_dir} has no {CUT_RECORD} (not made by tic cut); its source layers are unknown")
    try:
        rec = json.loads(p.read_text())
        rec["layers"] = [int(i) for i in rec["layers"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TicInputError(f"{p}: malformed cut record ({e})") from None
    return rec


__all__ = ["CutPlan", "check_out_dir", "choose_layers", "cut_model", "cut_settings", "is_tic_cut", "decoder_prefix", "decoder_tensors", "layer_keys", "layer_signatures",
           "map_tensor_names", "parse_layers", "plan_cut", "read_cut_record", "rewrite_config", "write_cut",
           "LAYER_RE"]
