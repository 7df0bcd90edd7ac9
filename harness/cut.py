"""Cut a small model (4-6 layers) out of a full checkpoint: choose layers, rewrite config.json, stream tensors.

The layer choice covers every operator class of the full model and, for each transition between layer kinds
that occurs in it, keeps one adjacent pair showing that transition. Per-layer config fields move together
(tic.harness.families.PER_LAYER_FIELDS); a per-layer field the table does not know stops the cut. Tensors
are copied byte range by byte range from the source shards (never a whole tensor in memory), so dtypes,
quantization scales and bytes are carried exactly.
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

from tic.harness.families import (NOT_PER_LAYER, PER_LAYER_FIELDS, QUANT_NAME_LISTS, Family, family,
                                  first_k_dense_is_moe, layer_kinds, num_layers)
from tic.harness.inventory import LAYER_RE, build_manifest, tensor_locations
from tic.core.errors import TicInputError

CUT_RECORD = "cut.json"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = 4 << 30
_COPY_THREADS = int(os.environ.get("TIC_CUT_THREADS", "8"))
_COPY_CHUNK = 64 << 20
_LAYER_KEY = re.compile(r"^(.*?)(?:^|(?<=\.))layers\.(\d+)\.(.+)$")


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


def layer_signatures(manifest: dict) -> list[str]:
    """One string per layer naming its operator classes (attention, mlp, dtypes, quantization)."""
    return [" ".join(L["classes"]) or "empty" for L in manifest["layers"]]


def _coverage(sel: set[int], sigs: list[str]) -> set[str]:
    cov = {f"class {c}" for i in sel for c in sigs[i].split()}
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
        plan.reasons[i] = [f"[{sigs[i]}]"] + [r for r in sorted(mine) if r.startswith("transition")
                                              or r.startswith("class attention") or r.startswith("class mlp")
                                              or r.startswith("class quant")]
    target = min(min_layers, n)
    while len(sel) < target:  # pad with neighbours so kept layers stay adjacent
        nxt = min(j for i in sel for j in (i + 1, i - 1) if 0 <= j < n and j not in sel)
        sel.add(nxt)
        plan.reasons[nxt] = [f"[{sigs[nxt]}]", f"padding to {target} layers (neighbour of a kept layer)"]
    if len(sel) > max_layers:
        raise TicInputError(f"covering every operator class and transition needs {len(sel)} layers "
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


# --- config rewrite --------------------------------------------------------------------------------------
def _moe_rule_for(kinds: list[bool]) -> tuple[int, int] | None:
    """(first_k_dense_replace, moe_layer_freq) giving exactly this MoE/dense sequence, if one exists."""
    n = len(kinds)
    for k in range(n + 1):
        for freq in range(1, n + 1):
            if all(first_k_dense_is_moe(j, {"first_k_dense_replace": k, "moe_layer_freq": freq}) == m
                   for j, m in enumerate(kinds)):
                return k, freq
    return None


def _renumber_module_name(name: str, new_index: dict[int, int]) -> str | None:
    """'model.layers.17.mlp' -> 'model.layers.3.mlp' (None when layer 17 is not kept)."""
    dropped = False

    def sub(m):
        nonlocal dropped
        i = int(m.group(2))
        if i not in new_index:
            dropped = True
            return m.group(0)
        return f"{m.group(1)}{new_index[i]}"

    out = re.sub(r"(layers(?:\\)?\.)(\d+)", sub, name)
    return None if dropped else out


def rewrite_config(cfg: dict, kept: list[int]) -> tuple[dict, list[str]]:
    """The cut's config.json: every per-layer field moved together; refuses fields it does not know."""
    n = num_layers(cfg)
    fam = family(cfg.get("model_type", "")) or Family()
    new_index = {i: j for j, i in enumerate(kept)}
    notes: list[str] = []
    out = dict(cfg)
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict):
            raise TicInputError(f"config.json: nested '{key}' (multimodal wrapper) is not supported by tic cut; "
                                "cut the text model's own checkpoint")
    for key, val in cfg.items():
        rule = PER_LAYER_FIELDS.get(key)
        if rule is None:
            if key in NOT_PER_LAYER or key == "quantization_config":
                continue
            if isinstance(val, list) and len(val) == n and n > 2:
                raise TicInputError(f"config.json: field '{key}' has one entry per layer and tic does not know how "
                                    "to cut it; add it to PER_LAYER_FIELDS in tic/harness/families.py")
            if "layer" in key.lower():
                raise TicInputError(f"config.json: field '{key}' names layers and tic does not know how to cut it; "
                                    "declare it in PER_LAYER_FIELDS or NOT_PER_LAYER in tic/harness/families.py")
            continue
        if rule == "count":
            out[key] = len(kept)
        elif rule == "list":
            if val is None:
                continue
            if not isinstance(val, list) or len(val) != n:
                raise TicInputError(f"config.json: '{key}' should list {n} layers, has "
                                    f"{len(val) if isinstance(val, list) else type(val).__name__}")
            out[key] = [val[i] for i in kept]
        elif rule == "index_list":
            if val is None:
                continue
            out[key] = [new_index[i] for i in sorted(set(val)) if i in new_index]
        elif rule == "threshold":
            if val is not None:
                out[key] = sum(1 for i in kept if i < int(val))
        elif rule == "pattern":
            if isinstance(val, str):
                if len(val) != n:
                    raise TicInputError(f"config.json: '{key}' has {len(val)} letters for {n} layers")
                out[key] = "".join(val[i] for i in kept)
        elif rule == "mtp":
            if val:
                notes.append(f"{key}={val}: MTP layer(s) dropped from the cut ({key} set to 0)")
            out[key] = 0
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        want = [first_k_dense_is_moe(i, cfg) for i in kept]
        rule = _moe_rule_for(want)
        if rule is None:
            raise TicInputError(f"no first_k_dense_replace/moe_layer_freq gives kept layers {kept} their MoE/dense "
                                "kinds; choose other layers")
        out["first_k_dense_replace"], out["moe_layer_freq"] = rule
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        q = dict(q)
        for key in QUANT_NAME_LISTS:
            if isinstance(q.get(key), list):
                kept_names = []
                for name in q[key]:
                    new = _renumber_module_name(name, new_index) if isinstance(name, str) else name
                    if new is not None:
                        kept_names.append(new)
                q[key] = kept_names
        out["quantization_config"] = q
    if fam.layer_types_key not in cfg and "num_hidden_layers" not in cfg:
        raise TicInputError("config.json: neither num_hidden_layers nor a per-layer type list; cannot cut")
    # the rewrite must give every kept layer its source kind; a rule the table lacks shows up here
    src, new = layer_kinds(cfg), layer_kinds(out)
    if len(new) != len(kept) or any(src[i] != new[j] for j, i in enumerate(kept)):
        bad = next((f"layer {i} -> {j}: {src[i]} became {new[j] if j < len(new) else 'missing'}"
                    for j, i in enumerate(kept) if j >= len(new) or src[i] != new[j]), "layer count differs")
        raise TicInputError(f"config rewrite does not preserve layer kinds ({bad}); a per-layer rule of "
                            f"{cfg.get('model_type')!r} is missing from tic/harness/families.py")
    return out, notes


# --- tensors ---------------------------------------------------------------------------------------------
def map_tensor_names(names: list[str], kept: list[int], n: int, fam: Family) -> tuple[dict[str, str], list[str]]:
    """source name -> cut name for kept tensors (layer keys renumbered), and notes on what was dropped."""
    new_index = {i: j for j, i in enumerate(kept)}
    prefixes: dict[str, set[int]] = {}
    for name in names:
        m = _LAYER_KEY.match(name)
        if m and not name.startswith(fam.mtp_prefixes):
            prefixes.setdefault(m.group(1), set()).add(int(m.group(2)))
    decoder = [p for p, idx in prefixes.items() if set(range(n)) <= idx]
    if len(decoder) != 1:
        raise TicInputError(f"cannot tell the decoder layers among tensor prefixes {sorted(prefixes)} "
                            f"(need exactly one holding layers 0..{n - 1})")
    decoder_prefix = decoder[0]
    others = sorted(p for p in prefixes if p != decoder_prefix)
    if others:
        raise TicInputError(f"layer-indexed tensors under {others[0]!r} besides the decoder's {decoder_prefix!r}; "
                            "tic cut does not know how to cut them")
    mapping, notes, mtp = {}, [], 0
    for name in names:
        if name.startswith(fam.mtp_prefixes):
            mtp += 1
            continue
        m = _LAYER_KEY.match(name)
        if not m:
            mapping[name] = name  # embeddings, final norm, head
            continue
        i = int(m.group(2))
        if i >= n:
            mtp += 1  # DeepSeek-style MTP layers sit after the decoder layers
        elif i in new_index:
            mapping[name] = f"{decoder_prefix}layers.{new_index[i]}.{m.group(3)}"
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
    from tic.harness.modelgen import read_model_config

    return read_model_config(Path(model_dir))


def plan_for(model_dir: Path, cfg: dict, layers=None, max_layers: int = 6, min_layers: int = 4) -> CutPlan:
    manifest = build_manifest(model_dir, cfg)
    sigs = layer_signatures(manifest)
    given = parse_layers(layers, len(sigs))
    if given is None:
        return choose_layers(sigs, max_layers, min_layers)
    need = requirements(sigs)
    plan = CutPlan(layers=given, requirements=sorted(need), auto=False,
                   uncovered=sorted(need - _coverage(set(given), sigs)))
    plan.reasons = {i: [f"[{sigs[i]}]", "given by --layers"] for i in given}
    return plan


def cut_model(model_dir: Path, out_dir: Path, layers=None, max_layers: int = 6, min_layers: int = 4,
              max_shard_bytes: int = DEFAULT_MAX_SHARD, fsync: bool = False) -> dict:
    """Cut model_dir into out_dir (written beside it, then renamed into place); returns the cut record.
    By default shards are left to the page cache: a torn write after a crash cannot pass unnoticed, since C2
    compares every kept tensor's layer bit for bit with its source. fsync=True makes the cut durable before
    returning, at the disk's write speed."""
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = _read_config(model_dir)
    if max_layers < 1:
        raise TicInputError(f"--max-layers must be at least 1, got {max_layers}")
    if out_dir.resolve() == model_dir.resolve():
        raise TicInputError("OUT_DIR is the model directory; choose another")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / CUT_RECORD).is_file():
        raise TicInputError(f"{out_dir} exists, is not empty and holds no earlier cut; choose an empty OUT_DIR")
    fam = family(cfg.get("model_type", "")) or Family()
    n = num_layers(cfg)
    plan = plan_for(model_dir, cfg, layers, max_layers, min_layers)
    new_cfg, notes = rewrite_config(cfg, plan.layers)
    locs = tensor_locations(model_dir)
    mapping, tnotes = map_tensor_names(list(locs), plan.layers, n, fam)
    notes += tnotes
    # source order (shard, offset): reads stay sequential
    renamed = [(mapping[s], locs[s]) for s in sorted(mapping, key=lambda s: (str(locs[s]["path"]), locs[s]["start"]))]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for p in model_dir.iterdir():  # tokenizer, generation config, ...: carried as they are
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json", CUT_RECORD):
                shutil.copy2(p, tmp / p.name)
        _, kept_bytes = write_shards(tmp, renamed, max_shard_bytes, fsync)
        (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2))
        record = {
            "source": str(model_dir.resolve()), "model_type": cfg.get("model_type"), "source_layers": n,
            "layers": plan.layers, "auto": plan.auto, "explanation": plan.explain(),
            "requirements": plan.requirements, "uncovered": plan.uncovered, "notes": notes,
            "tensors": len(renamed), "bytes_kept": kept_bytes,
            "bytes_source": sum(t["end"] - t["start"] for t in locs.values()),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        (tmp / CUT_RECORD).write_text(json.dumps(record, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
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


__all__ = ["CutPlan", "choose_layers", "cut_model", "layer_signatures", "map_tensor_names", "parse_layers",
           "plan_for", "read_cut_record", "rewrite_config", "LAYER_RE"]
