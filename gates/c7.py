"""C7: Backward vs independent reference. Declared here; measured by a later release (its verdict says so, never pass)."""

from tic.gates.base import Gate

GATE = Gate(
    id="C7", title="Backward vs independent reference", step=3,
    measures="gradients of the consistent training path vs an independent reference implementation",
    pass_condition="relative gradient error per parameter within the stated tolerance (the only gate with a tolerance)",
    inputs=[], artifacts=[], guide="guides/C7.md",
    implemented_by="a later release")
