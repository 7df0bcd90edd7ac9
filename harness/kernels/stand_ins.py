"""Values kernel code reads in place of a module's input: it says so here, and every token trail being recorded
listens (tic.harness.locate.provenance.Provenance, pushed while the locator's capture records one).

The wrappers' decoder layer normalises the two addends its input was summed from (vLLM's fused add+RMSNorm), not
the input itself: a trail that follows data would lose the input's tokens there. The locator sits floors above
the kernels, so it registers its trails here rather than the kernels importing it.
"""

from __future__ import annotations

import torch

# the trails being recorded now: objects with stand_in(x, values) (the locator's capture pushes and pops its own)
LISTENERS: list = []


def stands_for(x: torch.Tensor, *values) -> None:
    """`values` stand in for x: any trail being recorded gives them x's tokens (nothing without one)."""
    for trail in LISTENERS:
        trail.stand_in(x, values)
