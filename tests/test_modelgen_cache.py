"""The generated-weights cache under concurrent generators: a finished model directory is never replaced while
other processes may be reading it (a C0 on the H200 once read a file a second generator had just removed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tic.harness.model import generate as modelgen

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_finished_model_directory_is_kept_when_another_generator_finishes_later(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(EXAMPLES / "tiny-qwen3" / "config.json", cfg / "config.json")
    out = tmp_path / "cache" / "m"
    first = modelgen.generate_model(cfg, seed=0, out_dir=out)
    files = {p.name: os.stat(p).st_ino for p in first.iterdir()}
    # a second generator that checked the cache before the first one finished: it builds and renames too
    seen = iter([False])
    monkeypatch.setattr(modelgen, "has_weights", lambda d: next(seen, True) and any(Path(d).glob("*.safetensors")))
    again = modelgen.generate_model(cfg, seed=0, out_dir=out)
    assert again == out
    assert {p.name: os.stat(p).st_ino for p in out.iterdir()} == files  # the readers' files were not replaced
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".gen-")]  # its own copy was dropped


def test_a_leftover_without_weights_is_replaced(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(EXAMPLES / "tiny-qwen3" / "config.json", cfg / "config.json")
    out = tmp_path / "cache" / "m"
    out.mkdir(parents=True)
    (out / "stray.txt").write_text("half a model")
    modelgen.generate_model(cfg, seed=0, out_dir=out)
    assert modelgen.has_weights(out) and not (out / "stray.txt").exists()
