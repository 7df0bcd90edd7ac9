"""C9: Full model and restore. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C9", title="Full model and restore", step=4,
    measures="diff on the full model, scaled up stepwise, and on the first step after checkpoint restore",
    pass_condition="diff = 0 on the full model and on the first step after restore",
    inputs=[], artifacts=[], guide="guides/C9.md",
    implemented_by="a later release")
