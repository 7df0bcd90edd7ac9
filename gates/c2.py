"""C2: Small model cut. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C2", title="Small model cut", step=2,
    measures="a 4-6 layer cut of the full model: operator-class coverage, per-layer shapes/dtypes, layer fidelity",
    pass_condition="the cut loads; its manifest covers every operator class of the full model; per-layer shapes and dtypes equal the source layers'; each kept layer gives bitwise identical outputs to its source layer on the same hidden states",
    inputs=[], artifacts=[], guide="guides/C2.md",
    implemented_by="issue 3 (tic cut)")
