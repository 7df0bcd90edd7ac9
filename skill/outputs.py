"""No output replaces an input: every path a run writes (--junit, the state directory's records and artifacts, the
cut) is checked against every file and folder the run reads, as the run resolves them (symbolic links followed,
hard links by inode), before anything is written."""

from __future__ import annotations

import os
from pathlib import Path

from tic.core.errors import TicInputError
from tic.core.paths import is_within, real_path
from tic.gates.c2 import cut_request

MODEL_FILES = ("config.json", "model.safetensors.index.json")  # with every *.safetensors: what tic reads of a model


def run_inputs(ctx) -> tuple[dict[Path, str], dict[Path, str]]:
    """The files and the model folders a run reads (those that exist), each real path -> what it is."""
    cfg, files, model_dirs = ctx.cfg, {}, {}
    if cfg.source_file is not None:
        files[real_path(cfg.source_file)] = "the config file"
    dirs = []
    if cfg.model is not None:
        dirs.append((cfg.resolve(cfg.model.path), "the model directory"))
    if "model" in ctx.__dict__:  # generated weights: their cache folder (never generated here just to check)
        dirs.append((ctx.model.dir, "the model's weights"))
    dirs += [(cfg.resolve(s.model_path), f"scale_up stage {i}'s model") for i, s in enumerate(cfg.scale_up)
             if s.model_path is not None]
    for d, what in dirs:
        if d.is_dir():
            model_dirs[real_path(d)] = what
            for f in [*(d / n for n in MODEL_FILES), *d.glob("*.safetensors")]:
                if f.is_file():
                    files[real_path(f)] = f"{what}'s {f.name}"
    for side in ("rollout", "train"):
        c = getattr(cfg, side)
        if c.engine == "dump" and c.dump is not None:
            files[real_path(cfg.resolve(c.dump))] = f"the {side} dump"
    if cfg.prompts.source == "file" and cfg.prompts.file is not None:
        files[real_path(cfg.resolve(cfg.prompts.file))] = "the prompts file"
    return files, model_dirs


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(option: str, path: Path, files: dict[Path, str], model_dirs: dict[Path, str],
                      out_dirs: dict[Path, str]) -> None:
    real = real_path(path)
    for f, what in files.items():
        if real == f or _same_file(real, f):
            raise TicInputError(f"{option} {path} is {what}, an input of this run; write it elsewhere")
    for d, what in model_dirs.items():
        if real.parent == d and (real.suffix == ".safetensors" or real.name in MODEL_FILES):
            raise TicInputError(f"{option} {path} would become part of {what}; write it elsewhere")
    for d, what in out_dirs.items():
        if is_within(real, d):
            raise TicInputError(f"{option} {path} lies in {what}, which tic writes; write it elsewhere")
    if real.is_dir():
        raise TicInputError(f"{option} {path} is a directory")
    if not real.parent.is_dir():
        raise TicInputError(f"{option} {path}: folder {real.parent} does not exist")
    if not os.access(real.parent, os.W_OK | os.X_OK) or (real.exists() and not os.access(real, os.W_OK)):
        raise TicInputError(f"{option} {path} is not writable")


def check_output_dir(what: str, d: Path, files: dict[Path, str], model_dirs: dict[Path, str]) -> None:
    real = real_path(d)
    for p, name in [*files.items(), *model_dirs.items()]:
        if is_within(p, real):
            raise TicInputError(f"{what} {d} {'is' if p == real else 'holds'} {name}, an input of this run; "
                                "choose another folder")


def check_outputs(ctx, reads: set[str], gate_ids: list[str], outputs: dict[str, Path]) -> None:
    """Refuse (exit 2) any output of the run that names an input: a file it would replace, a folder it would
    rewrite holding one. outputs: option -> file (e.g. {"--junit": path})."""
    files, model_dirs = run_inputs(ctx)
    state = ctx.state
    out_dirs = {real_path(state.results_dir): "the state directory's results"}
    out_dirs.update({real_path(state.artifacts_dir(g)): f"{g}'s artifacts" for g in gate_ids})
    if "cut" in reads:
        req = cut_request(ctx.cfg, state)
        if req.named_by_user:
            out_dirs[real_path(req.out)] = "cut.out"
    for d, what in out_dirs.items():
        check_output_dir(what, d, files, model_dirs)
    for option, path in outputs.items():
        if path is not None:
            check_output_file(option, Path(path), files, model_dirs, out_dirs)
