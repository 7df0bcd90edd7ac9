"""Check every input a run will read before it writes anything: a bad input stops the run with one line and
exit 2 while .tic/ is exactly as it was.

What is checked follows from the gates in the run (Gate.reads, plus each gate's own validate): the state
directory, the model (config.json, weight headers), each live engine (engine, device, options), the prompts,
the dumps (every record, and how the two files pair), and the cut settings."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tic.core.errors import TicInputError
from tic.gates.c2 import cut_request
from tic.harness.engines.dump import check_dump, iter_dump, pair_with_dump
from tic.harness.engines.vllm import check_options
from tic.harness.model.cut_check import must_build
from tic.harness.model.generate import check_loadable_config
from tic.harness.model.inventory import tensor_locations
from tic.skill.fingerprint import reads_of
from tic.skill.outputs import check_outputs


def check_state_dir(state_dir: Path, gate_ids=()) -> None:
    """The state directory and the folders tic writes in it must be directories (or not exist yet), under a
    writable directory; each record the run writes must be a file (or not exist yet). Pass the state directory
    as the run resolves it (cfg.state_path: relative to tic.yaml's folder)."""
    root = Path(state_dir)
    for p in (root, root / "results", root / "artifacts"):
        if p.is_symlink() and not p.exists():
            raise TicInputError(f"state_dir: {p} is a symbolic link to nothing ({os.readlink(p)})")
        if p.exists() and not p.is_dir():
            raise TicInputError(f"state_dir: {p} exists and is not a directory")
        if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):  # else found only when the first record is saved
            raise TicInputError(f"state_dir: {p} is not writable")
    for g in gate_ids:
        rec = root / "results" / f"{g}.json"
        if rec.is_symlink() or (rec.exists() and not rec.is_file()):
            raise TicInputError(f"state_dir: the record {rec} exists and is not a regular file")
    first = root
    while not first.exists():
        if first.parent == first:
            break
        first = first.parent
    if not first.is_dir():
        raise TicInputError(f"state_dir: {first} is not a directory, so {root} cannot be made")
    if not os.access(first, os.W_OK | os.X_OK):
        raise TicInputError(f"state_dir: {first} is not writable")


def check_engine(ctx, side: str) -> None:
    """What building the side's live engine would refuse, without building it."""
    import torch

    c = getattr(ctx.cfg, side)
    if c.tensor_parallel_size != 1:
        raise TicInputError(f"{side}.tensor_parallel_size={c.tensor_parallel_size}: TP>1 puts a cross-GPU "
                            "all-reduce on the compared path, which the method does not cover")
    if c.engine == "megatron":  # the Megatron train engine (issue 32)
        from tic.harness.engines.megatron import refusals, require_megatron

        why = refusals(c) if side == "train" else ["megatron is a train engine; use rollout.engine: hf or vllm"]
        if why:
            raise TicInputError(f"{side}: {why[0]}")
        require_megatron()
    if c.engine == "vllm":
        if side != "rollout":
            raise TicInputError(f"{side}.engine: vllm is a rollout engine; use hf or dump")
        check_options(c.options)
        if not torch.cuda.is_available():
            raise TicInputError("rollout.engine is vllm but torch sees no CUDA GPU (vLLM needs one)")
        if importlib.util.find_spec("vllm") is None:
            raise TicInputError("rollout.engine is vllm but vLLM is not installed; install tic[vllm] on a GPU machine")
    device = getattr(c, "device", "cpu")
    if device != "cpu":
        if c.engine in ("hf", "megatron") and c.kernels == "consistent":
            raise TicInputError(f"{side}: kernels: consistent are CPU kernels; use device: cpu")
        if not torch.cuda.is_available():
            raise TicInputError(f"{side}.device is {device!r} but torch sees no CUDA GPU")


def check_records_fit_model(ctx, path: Path) -> None:
    """A rollout dump a live train engine will score: every sequence needs a prompt (the first response token
    is predicted from it) and token ids inside the model's vocabulary."""
    vocab = ctx.vocab_size
    for i, s in enumerate(iter_dump(path)):
        where = s.meta.get("source", f"{path} record {i}")
        if not s.prompt_ids:
            raise TicInputError(f"{where}: empty prompt_ids; the train engine predicts the first response token "
                                "from the prompt")
        bad = next((t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise TicInputError(f"{where}: token id {bad} outside the vocabulary (size {vocab})")


def check_dumps(ctx, reads: set[str]) -> None:
    cfg = ctx.cfg
    dumps = {side: cfg.resolve(getattr(cfg, side).dump) for side in ("rollout", "train")
             if side in reads and getattr(cfg, side).engine == "dump"}
    if len(dumps) == 2:
        r, t = dumps["rollout"], dumps["train"]
        if r.is_file() and t.is_file() and r.samefile(t):
            raise TicInputError(f"rollout and train dumps are the same file ({r}); a file compared with itself "
                                "proves nothing")
        for _ in pair_with_dump(iter_dump(r), t, f"train dump {t.name}"):
            pass
    else:
        for path in dumps.values():
            check_dump(path)
    if "rollout" in dumps and "train" in reads and cfg.train.engine != "dump":
        check_records_fit_model(ctx, dumps["rollout"])


def check_cut(ctx) -> None:
    must_build(cut_request(ctx.cfg, ctx.state), ctx.model.dir, ctx.model_hash)


def check_positions(ctx) -> None:
    """A live rollout writes prompt + max_tokens positions: past the model's max_position_embeddings the run
    would go on outside what the model was made for (and, for a typo such as max_tokens: 900000, for hours)."""
    text = ctx.model_config.get("text_config", ctx.model_config)
    limit = text.get("max_position_embeddings") if isinstance(text, dict) else None
    if not isinstance(limit, int) or isinstance(limit, bool):
        return
    p = ctx.cfg.prompts
    longest = max(map(len, ctx.prompts)) if p.source == "file" else p.max_len
    need = longest + ctx.cfg.sampling.max_tokens
    if need > limit:
        raise TicInputError(f"prompts of up to {longest} tokens + sampling.max_tokens {ctx.cfg.sampling.max_tokens} "
                            f"= {need} positions, past the model's max_position_embeddings {limit}")


def validate_run(ctx, gates, outputs: dict[str, Path] | None = None) -> None:
    """Raise TicInputError for the first bad input any of these gates would read, or for an output (`outputs`:
    what -> file, e.g. {"--junit": path}) that would replace an input; write nothing."""
    check_state_dir(ctx.cfg.state_path, [g.id for g in gates])
    gates = [g for g in gates if not g.implemented_by]  # a later release's gate reads nothing
    reads: set[str] = {r for g in gates for r in reads_of(g)}
    cfg = ctx.cfg
    live = [s for s in ("rollout", "train") if s in reads and getattr(cfg, s).engine != "dump"]
    if "model" in reads or "cut" in reads or live:
        ctx.model_config  # noqa: B018 - config.json checked (UTF-8, model_type, sizes)
        ctx.vocab_size  # noqa: B018
        check_loadable_config(ctx.model_source_dir)
        tensor_locations(ctx.model.dir)  # every weight header (the weights themselves are not read)
    for side in live:
        check_engine(ctx, side)
    if "rollout" in live and "prompts" in reads and cfg.prompts.source == "file":
        ctx.prompts  # noqa: B018 - the prompts file, each token inside the vocabulary
    if "rollout" in live and "prompts" in reads:
        check_positions(ctx)
    check_dumps(ctx, reads)
    if "cut" in reads:
        check_cut(ctx)
    for g in gates:
        if g.validate is not None:
            g.validate(ctx)
    check_outputs(ctx, reads, [g.id for g in gates], outputs or {})
