"""`tic cut`: cut a 4-6 layer small model out of a full checkpoint (the cut C2 then checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tic.core.errors import EXIT_FAIL, TicInputError


def _generated_weights(model_dir: Path, cfg) -> Path:
    """A config-only MODEL_DIR whose weights tic.yaml generates from a seed (model.generate): the generated
    checkpoint (built now if not cached) is what gets cut."""
    from tic.harness.model.generate import resolve_model_dir
    from tic.config.schema import CONFIG_NAME, load_config

    if cfg is None and Path(CONFIG_NAME).is_file():  # the tic.yaml of the working directory
        cfg = load_config(Path(CONFIG_NAME))
    own = (cfg is not None and cfg.model is not None and cfg.model.generate is not None
           and cfg.resolve(cfg.model.path).resolve() == model_dir.resolve())
    if not own:
        raise TicInputError(f"no weights found (no *.safetensors in {model_dir}), so nothing to cut; if tic.yaml generates its weights "
                            "(model: {path: ..., generate: {seed: N}}), run tic cut beside that tic.yaml or pass "
                            "-c PATH/TO/tic.yaml")
    return resolve_model_dir(cfg)


@click.command("cut")
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.argument("out_dir", required=False, type=click.Path(path_type=Path))
@click.option("--layers", default=None, help="'auto' (default) or comma-separated source layer indices, e.g. 3,4,17")
@click.option("--max-layers", type=int, default=None, help="auto: at most this many layers (default 6)")
@click.option("-c", "--config", "config_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="take MODEL_DIR (model.path) and OUT_DIR/--layers/--max-layers (cut:) from this tic.yaml")
@click.option("--fsync", is_flag=True, help="flush the shards to disk before returning (durable, slower)")
@click.option("--no-check", is_flag=True,
              help="skip C2's checks after cutting (they load the full model; use for a model too large for RAM)")
@click.option("--json", "as_json", is_flag=True, help="print the cut record on stdout")
def command(model_dir, out_dir, layers, max_layers, config_path, fsync, no_check, as_json):
    """Cut MODEL_DIR into OUT_DIR keeping layers that cover every layer kind (as transformers builds it) and
    every transition between kinds; the config is rewritten and proven to build each kept layer as its source,
    quantization tensors and dtypes move with their layers. Then C2's checks run on the cut: exit 1 when the
    cut is wrong, 2 when no config rewrite reproduces the kept layers.

    \b
    Without MODEL_DIR/OUT_DIR, both come from tic.yaml (model.path, cut.out). A MODEL_DIR holding only
    config.json is cut from the weights tic.yaml generates for it (model.generate), generated first if needed."""
    from tic.harness.model.cut import cut_model
    from tic.harness.model.generate import has_weights, resolve_model_dir
    from tic.config.schema import load_config

    cfg = None
    if config_path is not None or model_dir is None or out_dir is None:
        cfg = load_config(config_path)
    section = cfg.cut if cfg is not None else None
    if model_dir is None:
        if cfg.model is None:
            raise TicInputError("no MODEL_DIR given and tic.yaml has no 'model: {path: DIR}'")
        model_dir = resolve_model_dir(cfg)
    if out_dir is None:
        if section is None or section.out is None:
            raise TicInputError("no OUT_DIR given and tic.yaml has no 'cut: {out: DIR}'")
        out_dir = cfg.resolve(section.out)
    if not Path(model_dir).is_dir():
        raise TicInputError(f"model directory not found: {model_dir}")
    if not has_weights(Path(model_dir)):
        model_dir = _generated_weights(Path(model_dir), cfg)
    if layers is None:
        layers = section.layers if section is not None else "auto"
    if max_layers is None:
        max_layers = section.max_layers if section is not None else 6
    from tic.skill import report

    with report.progress(f"cutting {model_dir} ...", as_json):
        rec = cut_model(Path(model_dir), Path(out_dir), layers=layers, max_layers=max_layers, fsync=fsync)
    problems = None
    if not no_check:
        from tic.harness.model.cut_check import check_cut

        with report.progress("checking the cut (C2's checks) ...", as_json):
            check = check_cut(Path(model_dir), Path(out_dir))
        problems = check["problems"]
        rec["check"] = {"problems": problems, "engines_checked": check.get("engines_checked", ["hf"])}
    if as_json:
        click.echo(json.dumps(rec, indent=2))
        if problems:
            sys.exit(EXIT_FAIL)
        return
    for line in rec["explanation"]:
        click.echo(line)
    for note in rec["notes"]:
        click.echo(f"note: {note}")
    if rec["uncovered"]:
        click.echo("warning: the given layers leave requirements uncovered; C2 will say which classes are missing")
    click.echo(f"wrote {out_dir}: {len(rec['layers'])} of {rec['source_layers']} layers, {rec['tensors']} tensors, "
               f"{rec['bytes_kept']} bytes ({rec['seconds']} s)")
    if problems is None:
        click.echo("C2's checks skipped (--no-check)")
    elif problems:
        more = f" (+{len(problems) - 1} more; tic gate C2 lists them)" if len(problems) > 1 else ""
        click.echo(f"tic: the cut fails C2's checks: {problems[0]}{more}", err=True)
        sys.exit(EXIT_FAIL)
    else:
        click.echo(f"C2's checks pass on the cut (engines: {', '.join(rec['check']['engines_checked'])})")
