"""C6: Training layout invariance. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C6", title="Training layout invariance", step=3,
    measures="training logprobs under different micro-batch sizes, padding sides and packing",
    pass_condition="every layout's logprobs are bitwise equal to the reference layout's",
    inputs=[], artifacts=[], guide="guides/C6.md",
    implemented_by="a later release")
