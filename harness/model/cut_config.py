"""The cut's config.json: rewritten for the kept layers by whichever rule reproduces their structure, and proven.

A cut config is right when transformers builds every cut layer exactly as it builds the source layer it came
from (tic.harness.model.layer_structure records, compared on the meta device) and everything outside the decoder
layers (embeddings, head, vision tower) unchanged. Candidate rewrites are tried in order, the first proven one
wins:
  1. the family hint (tic.harness.model.families), where the family is known;
  2. generic: the layer count set; every per-layer list (and one-letter-per-layer pattern string) sliced to
     the kept layers; lists of layer indices renumbered;
  3. the same, with the per-layer lists transformers derives from scalar rules (e.g. layer_types from a
     sliding-window pattern) written out explicitly;
and, from each, a search over the scalar index rules (first_k_dense_replace, *_period/*_offset,
decoder_sparse_step, ...) one field at a time, keeping a change when more cut layers match. Among proven
candidates, one the family table also agrees with is preferred (it models fields other engines read). No
candidate proven: the cut is refused, naming the first layer whose structure differs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tic.core.errors import TicInputError
from tic.harness.model.inventory import LAYER_LIST
from tic.harness.model.families import (NOT_PER_LAYER, PER_LAYER_FIELDS, QUANT_NAME_LISTS, family, first_k_dense_is_moe,
                                        layer_kinds)
from tic.harness.model.layer_structure import (ModelStructure, first_difference, model_structure, parse_config,
                                               text_config, with_text_config)

# scalar fields that may encode which layer is which kind (searched when slicing lists is not enough)
_RULE_NAME = re.compile(r"layer|period|offset|step|freq|interval|every|first_k|sparse|dense|pattern|idx|indices|ids$", re.I)
_NOT_RULE = re.compile(r"_size$|_dim$|heads|eps|epsilon|dropout|_tok$|vocab|_rank$|scale|init|norm|"
                       r"num_hidden_layers|nextn|mtp", re.I)
_MAX_SEARCH_ROUNDS = 4
# lists that may happen to have one entry per layer but are not indexed by layer
_NOT_LAYER_LISTS = frozenset({"quantization_config", "architectures", "rope_scaling", "rope_parameters"})


@dataclass
class Proof:
    """Outcome of building a candidate cut config on meta and comparing it with the source layers."""
    matched: int
    problem: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problem is None


def prove(source: ModelStructure, cut_cfg: dict, kept: list[int]) -> Proof:
    """Build cut_cfg on meta; every cut layer j must equal source layer kept[j], the rest of the model unchanged."""
    try:
        cut = model_structure(cut_cfg)
    except TicInputError as e:
        return Proof(-1, f"the cut config does not build: {e}")
    except Exception as e:  # noqa: BLE001 - a candidate transformers cannot build is simply wrong
        return Proof(-1, f"the cut config does not build: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if cut.n != len(kept):
        return Proof(-1, f"the cut config builds {cut.n} decoder layers, {len(kept)} kept")
    matched, problem = 0, None
    for j, i in enumerate(kept):
        if cut.layers[j] == source.layers[i]:
            matched += 1
        elif problem is None:
            problem = (f"cut layer {j} (source layer {i}) would be built differently: "
                       f"{first_difference(cut.layers[j], source.layers[i])}")
    if problem is None and cut.outside != source.outside:
        diff = sorted(set(cut.outside) ^ set(source.outside))[:2]
        problem = f"the cut config changes weights outside the decoder layers: {diff}"
    return Proof(matched, problem)


# --- candidate rewrites ---------------------------------------------------------------------------------------
def _count_keys(text_cfg: dict, n: int) -> list[str]:
    """Fields holding the layer count: num_hidden_layers or whatever the config class maps to it."""
    keys = {"num_hidden_layers"}
    try:
        amap = getattr(type(parse_config({"model_type": text_cfg["model_type"]})), "attribute_map", {}) or {}
        keys |= {k for k, v in amap.items() if v == "num_hidden_layers"}
    except (TicInputError, KeyError):
        pass
    return [k for k in keys if text_cfg.get(k) == n]


def _is_index_list(val, n: int) -> bool:
    return (isinstance(val, list) and bool(val) and all(isinstance(x, int) and not isinstance(x, bool) for x in val)
            and all(0 <= x < n for x in val) and len(set(val)) == len(val))


def generic_rewrite(text_cfg: dict, kept: list[int], n: int, extra_lists: dict | None = None) -> dict:
    """Count set, per-layer lists/pattern strings sliced, layer-index lists renumbered (extra_lists: per-layer
    lists to write out although the source config leaves them derived)."""
    new_index = {i: j for j, i in enumerate(kept)}
    out = dict(text_cfg)
    for key, val in {**text_cfg, **(extra_lists or {})}.items():
        if key in NOT_PER_LAYER or key in _NOT_LAYER_LISTS or key.endswith(("token_id", "token_ids")):
            continue
        if isinstance(val, list) and len(val) == n:
            out[key] = [val[i] for i in kept]
        elif _is_index_list(val, n) and _RULE_NAME.search(key):
            out[key] = [new_index[i] for i in sorted(val) if i in new_index]
        elif isinstance(val, str) and len(val) == n and _RULE_NAME.search(key):
            out[key] = "".join(val[i] for i in kept)
    for key in _count_keys(text_cfg, n):
        out[key] = len(kept)
    for key, rule in PER_LAYER_FIELDS.items():  # multi-token-prediction layers are not part of a cut
        if rule == "mtp" and text_cfg.get(key):
            out[key] = 0
    return out


def _moe_rule_for(kinds: list[bool]) -> tuple[int, int] | None:
    """(first_k_dense_replace, moe_layer_freq) giving exactly this MoE/dense sequence, if one exists."""
    n = len(kinds)
    for k in range(n + 1):
        for freq in range(1, n + 1):
            if all(first_k_dense_is_moe(j, {"first_k_dense_replace": k, "moe_layer_freq": freq}) == m
                   for j, m in enumerate(kinds)):
                return k, freq
    return None


def hint_rewrite(text_cfg: dict, kept: list[int], n: int) -> dict | None:
    """The family table's rules (tic.harness.model.families.PER_LAYER_FIELDS); None when they give nothing new."""
    out = generic_rewrite(text_cfg, kept, n)
    changed = False
    if text_cfg.get("max_window_layers") is not None:
        out["max_window_layers"] = sum(1 for i in kept if i < int(text_cfg["max_window_layers"]))
        changed = True
    if "first_k_dense_replace" in text_cfg or "moe_layer_freq" in text_cfg:
        rule = _moe_rule_for([first_k_dense_is_moe(i, text_cfg) for i in kept])
        if rule is not None:
            out["first_k_dense_replace"], out["moe_layer_freq"] = rule
            changed = True
    return out if changed else None


def derived_lists(cfg: dict, n: int) -> dict:
    """Per-layer lists transformers derives while parsing (e.g. layer_types from a pattern) but the source
    config.json does not spell out."""
    try:
        parsed = parse_config(cfg).get_text_config().to_dict()
    except TicInputError:
        return {}
    raw = text_config(cfg)
    return {k: v for k, v in parsed.items() if isinstance(v, list) and len(v) == n and raw.get(k) is None}


def _rule_fields(text_cfg: dict) -> list[str]:
    return [k for k, v in text_cfg.items() if isinstance(v, int) and not isinstance(v, bool)
            and _RULE_NAME.search(k) and not _NOT_RULE.search(k)]


def _search(source: ModelStructure, cfg: dict, base: dict, kept: list[int], tried: list) -> tuple[dict, Proof]:
    """From base, change one scalar index rule at a time while that makes more cut layers match."""
    best_cfg, best = base, prove(source, with_text_config(cfg, base), kept)
    tried.append(best)
    fields = _rule_fields(base)
    values = range(0, max(len(kept), 1) + 2)
    for _ in range(_MAX_SEARCH_ROUNDS):
        if best.ok or not fields:
            break
        improved = None
        for key in fields:
            src_v = text_config(cfg).get(key)
            for v in sorted(set(values) | ({src_v} if isinstance(src_v, int) else set())):
                if v == best_cfg.get(key):
                    continue
                cand = {**best_cfg, key: v}
                p = prove(source, with_text_config(cfg, cand), kept)
                tried.append(p)
                if p.matched > best.matched or (p.ok and not best.ok):
                    if improved is None or p.matched > improved[1].matched or p.ok:
                        improved = (cand, p)
                if p.ok:
                    break
            if improved is not None and improved[1].ok:
                break
        if improved is None:
            break
        best_cfg, best = improved
    return best_cfg, best


def rewrite_config(cfg: dict, kept: list[int], source: ModelStructure | None = None) -> tuple[dict, list[str]]:
    """The cut's config.json for the kept source layers, proven on meta; refuses (TicInputError) when no
    candidate rewrite reproduces every kept layer's structure."""
    source = source or model_structure(cfg)
    n = source.n
    tcfg = text_config(cfg)
    bases = []
    hint = hint_rewrite(tcfg, kept, n)
    if hint is not None:
        bases.append(("family hint", hint))
    bases.append(("generic", generic_rewrite(tcfg, kept, n)))
    derived = derived_lists(cfg, n)
    if derived:
        bases.append(("derived lists written out", generic_rewrite(tcfg, kept, n, derived)))
    tried: list[Proof] = []
    best, proven = None, []
    for name, base in bases:
        new_text, proof = _search(source, cfg, base, kept, tried)
        if proof.ok:
            proven.append((name, new_text))
            if _family_agrees(tcfg, new_text, kept):
                break
        elif best is None or proof.matched > best.matched:
            best = proof
    if not proven:
        raise TicInputError(f"no config rewrite reproduces the kept layers {kept} ({len(tried)} tried); the closest: "
                            f"{best.problem}")
    # transformers proves the structure; the family table also models fields only other engines read (e.g.
    # vLLM's moe_layer_freq), so a rewrite both agree on is preferred
    name, new_text = next(((nm, t) for nm, t in proven if _family_agrees(tcfg, t, kept)), proven[0])
    out = rename_quant_modules(with_text_config(cfg, new_text), kept)
    changed = sorted(k for k in set(new_text) | set(tcfg)
                     if new_text.get(k) != tcfg.get(k) and not isinstance(new_text.get(k), (list, str)))
    notes = [f"config rewrite: {name}; proven on meta ({len(kept)} layers built as their sources)"]
    if not _family_agrees(tcfg, new_text, kept):
        notes.append("the family table (tic.harness.model.families) reads other layer kinds from this config; engines "
                     "that follow it (vLLM) may build the cut differently")
    notes += [f"{k}: {tcfg.get(k)} -> {new_text.get(k)}" for k in changed]
    return out, notes


def _family_agrees(src_text: dict, cut_text: dict, kept: list[int]) -> bool:
    """The family table's per-layer kinds of the cut equal those of the kept source layers (True when the
    family is unknown: nothing to disagree with)."""
    if family(src_text.get("model_type", "")) is None:
        return True
    try:
        src, cut = layer_kinds(src_text), layer_kinds(cut_text)
    except (TypeError, ValueError, KeyError):
        return True
    return len(cut) == len(kept) and all(src[i] == cut[j] for j, i in enumerate(kept))


def check_rewrite(cfg: dict, cut_cfg: dict, kept: list[int]) -> Proof:
    """Prove a given cut config (e.g. one written by hand) against its source layers."""
    return prove(model_structure(cfg), cut_cfg, kept)


# --- quantization config ----------------------------------------------------------------------------------------
def _renumber_module_name(name: str, new_index: dict[int, int]) -> str | None:
    """'model.layers.17.mlp' -> 'model.layers.3.mlp' ('transformer.h.17' alike; None when layer 17 is not kept);
    regex entries ('re:...') and names under a vision tower are left as they are."""
    if name.startswith("re:") or re.search(r"vision|visual", name):
        return name
    m = re.search(r"(?:^|\.)" + LAYER_LIST + r"\.(\d+)(?=\.|$)", name)
    if m is None:
        return name
    i = int(m.group(1))
    if i not in new_index:
        return None
    return name[:m.start(1)] + str(new_index[i]) + name[m.end(1):]


def rename_quant_modules(cfg: dict, kept: list[int]) -> dict:
    """Module-name lists of quantization_config (ignored modules, ...) follow their layers."""
    new_index = {i: j for j, i in enumerate(kept)}
    out = dict(cfg)
    for holder in (out, out.get("text_config") if isinstance(out.get("text_config"), dict) else None):
        if holder is None or not isinstance(holder.get("quantization_config"), dict):
            continue
        q = dict(holder["quantization_config"])
        for key in QUANT_NAME_LISTS:
            if isinstance(q.get(key), list):
                q[key] = [new for name in q[key]
                          if (new := (_renumber_module_name(name, new_index)
                                      if isinstance(name, str) else name)) is not None]
        holder["quantization_config"] = q
    return json.loads(json.dumps(out))
