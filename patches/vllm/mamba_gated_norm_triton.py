"""Mamba-2's grouped gated RMSNorm through vLLM's Triton kernel, one program per row and group.

vLLM 0.26's Mixer2RMSNormGated runs its Triton kernel `rms_norm_gated` only for a single group; with several
groups (NemotronH, Mamba-2 checkpoints with n_groups > 1) it falls back to torch's `forward_native`, whose
per-group mean is one `aten.mean` over a [tokens, groups, group_size] view. That reduction's launch follows the
tensor's shape, so a decode step (a few rows) and a prefill or training forward (many) sum a group in different
orders. The Triton kernel takes `group_size` and computes each (row, group) in a program of its own, over a block
fixed by the group size: no row count enters. This patch sends the several-group case (TP 1) there too.
"""

from __future__ import annotations

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch

NAME = "mamba-gated-norm-triton"
_HOME = "vllm.model_executor.layers.mamba.mamba_mixer2"


def _grouped_through_triton(original):
    def forward_cuda(self, x, gate):
        if not self.use_rms_norm or self.tp_size != 1:
            return original(self, x, gate)
        from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated

        return rms_norm_gated(x, self.weight.data, bias=None, z=gate, eps=self.variance_epsilon,
                              group_size=self.group_size, norm_before_gate=False)
    return forward_cuda


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C3",
    symptom="C3 or C4 fails in a Mamba-2 mixer's norm (`mixer.norm`, operator aten.mean.dim) of a model with "
            "n_groups > 1 (NemotronH): vLLM's grouped gated norm runs torch's forward_native, whose mean follows the "
            "batch's row count",
    fix="Mixer2RMSNormGated at TP 1 runs vLLM's Triton rms_norm_gated with its group size for any number of "
        "groups (one program per row and group); applied before the engine builds its model (the plugin does)",
    guide="guides/ops/recurrent-layers.md",
    cost="not measured: one Triton launch instead of a few torch element-wise and reduction kernels",
    **swap_hooks(NAME, methods=((_HOME, "Mixer2RMSNormGated", "forward_cuda", _grouped_through_triton),)),
)
