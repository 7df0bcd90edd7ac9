"""Shared test fixtures. Generated model weights go to a per-session cache, never ~/.cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# what running an example in place leaves beside it (generated weights, each config's state): never copied
EXAMPLE_OUTPUTS = shutil.ignore_patterns("weights", ".tic", ".tic-*")

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def tic_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("tic-cache")
    old = os.environ.get("TIC_CACHE")
    os.environ["TIC_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("TIC_CACHE", None)
    else:
        os.environ["TIC_CACHE"] = old


@pytest.fixture(scope="session")
def model_with_weights(tmp_path_factory):
    """examples/tiny-qwen3 with its seeded weights inside the directory (generated once per session)."""
    from tic.harness.model.generate import generate_model

    d = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(EXAMPLES / "tiny-qwen3", d, ignore=EXAMPLE_OUTPUTS)
    w = generate_model(d, seed=0, out_dir=d / "w")
    for f in w.iterdir():
        if f.suffix == ".safetensors":
            shutil.move(str(f), d / f.name)
    shutil.rmtree(w)
    return d


def _tree_hash(root: Path) -> str:
    """Hash of every path, file content and kind under root ('absent' when root does not exist)."""
    import hashlib

    root = Path(root)
    if not root.exists():
        return "absent"
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes() if p.is_file() else b"<dir>")
    return h.hexdigest()


@pytest.fixture
def tree_hash():
    return _tree_hash


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in an empty directory so .tic/ lands in tmp."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def example(tmp_path):
    """Copy an example directory (config.json + tic*.yaml) into tmp; returns a function name -> Path."""

    def copy(name: str) -> Path:
        dst = tmp_path / "ex" / name
        shutil.copytree(EXAMPLES / name, dst, ignore=EXAMPLE_OUTPUTS)
        return dst

    return copy


@pytest.fixture
def tic(capsys):
    """Run the CLI in-process: returns (exit_code, stdout, stderr)."""
    from tic.skill.cli import main

    def run(*args: str):
        code = 0
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def one_thread():
    """Tiny models on one thread: more threads only add contention on a shared 2-core CI machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A stand-in vLLM (tests/support/tic_fake_vllm.py) importable in this process; vLLM's modules and every
    bundled patch reverted afterwards."""
    import sys

    from tic import patches

    sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
    from tic_fake_vllm import make_fake_vllm

    root = make_fake_vllm(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    yield root
    patches.apply([])
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[m]
