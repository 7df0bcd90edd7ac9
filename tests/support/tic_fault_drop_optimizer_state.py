"""Planted fault for C9, imported in the fresh restore process through TIC_PRELOAD: the restore loads the
weights but drops the optimizer state (AdamW starts again from zero moments and step 0)."""

from collections import defaultdict

from tic.harness.measure import rl

_restore = rl.PolicyGradientTrainer.restore


def _restore_dropping_optimizer_state(self, directory):
    info = _restore(self, directory)
    self.optimizer.state = defaultdict(dict)
    return info


rl.PolicyGradientTrainer.restore = _restore_dropping_optimizer_state
