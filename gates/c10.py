"""C10: Performance vs frozen baseline. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C10", title="Performance vs frozen baseline", step=5,
    measures="rollout throughput of the consistent version vs the frozen C1 baseline, paired, same image",
    pass_condition="consistent throughput >= 70% of the frozen baseline, with diff still 0",
    inputs=[], artifacts=[], guide="guides/C10.md",
    implemented_by="a later release")
