"""Runs the extension contract's test template (examples/extend/test_new_operator.py, shipped with the skill for
an agent to copy) as part of the suite: the template must pass on the operator it names, and its plants must fail."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "examples" / "extend" / "test_new_operator.py"
_spec = importlib.util.spec_from_file_location("tic_extend_template", _PATH)
_template = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_template)

# pytest collects what this module holds: the template's tests and its fixture
globals().update({k: v for k, v in vars(_template).items() if k.startswith("test_") or k == "models"})
