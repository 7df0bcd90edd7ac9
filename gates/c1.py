"""C1: Frozen performance baseline. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C1", title="Frozen performance baseline", step=1,
    measures="rollout throughput of the tuned, non-consistent baseline, frozen for human review",
    pass_condition="a baseline record exists with its config hash and raw timings, and is frozen (later runs cannot rewrite it)",
    inputs=[], artifacts=[], guide="guides/C1.md",
    implemented_by="a later release (baseline freezing)")
