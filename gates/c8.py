"""C8: Two RL updates with weight sync. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C8", title="Two RL updates with weight sync", step=4,
    measures="diff before and after each of two updates, rollout and train on the same weight version",
    pass_condition="diff = 0 (all metrics exactly 0) at both updates, after weight sync",
    inputs=[], artifacts=[], guide="guides/C8.md",
    implemented_by="a later release")
