"""Mamba-1 prefill as decode steps: vLLM's selective-scan prefill replaced by its decode kernel, token by token.

vLLM 0.26 prefills a Mamba-1 mixer (MambaMixer: Mamba, FalconMamba, Jamba) with `selective_scan_fn`, a CUDA
block-parallel scan whose thread count, and with it the tree that composes a token's state, follows the longest
sequence of the launch; it decodes with the Triton `selective_state_update`, one token from the stored state. A
decoded token's logprob therefore differs from the same token prefilled (C4) and from a training forward (C5), and
a prefill depends on the other sequences of its step.

The patch makes every token of a prefill one step of the decode kernel: for position t = 0, 1, ... of the step's
longest prompt, one `selective_state_update` over the prefilling sequences that have a token at t, each from its
state slot (zeroed first for a sequence without an initial state; a chunked-prefill continuation starts from the
state vLLM kept). Each step is the decode's arithmetic on the decode's layouts (token-major rows of x, dt, B, C, z),
so prefill and decode agree for any batch and split, and the training forward runs the same kernel token by token
(tic.harness.kernels.vllm_mamba). The decode conv runs the prefill's conv kernel over the carried window (as
mamba-decode-replay does for Mamba-2), and the decode kernel's launch config is pinned to vLLM's batch-free default
(vLLM picks it from a table keyed by the batch, and the config sets the order of the sum over the state).

The state between tokens is stored in the cache's dtype: the rollout must run with mamba_ssm_cache_dtype float32,
the training side's (C0 says so). Prefix caching of Mamba states is refused by C0, and its mamba_cache_mode all
stops the mixer with the reason. Cost: one kernel launch per prompt position per mixer (plus four gathers), which
makes long prefills slow; decode is vLLM's own.
"""

from __future__ import annotations

import functools

from tic.patches._swap import swap_hooks
from tic.patches.base import Patch
from tic.patches.vllm.mamba_decode_replay import conv_as_prefill

NAME = "mamba1-prefill-steps"
_MIXER = "vllm.model_executor.layers.mamba.mamba_mixer"
_SSM = "vllm.model_executor.layers.mamba.ops.mamba_ssm"


def pinned_ssm_config(original):
    """vLLM's batch-free default launch config of selective_state_update, for every batch (an override set by
    vLLM's own tuning context still wins)."""
    import sys

    ssm = sys.modules[original.__module__]  # the kernel's module: its override and default, read per call

    @functools.wraps(original)
    def config(headdim, dstate, batch, nheads, cache_dtype, is_blackwell):
        if getattr(ssm, "_ssm_config_override", None) is not None:
            return ssm._ssm_config_override
        return ssm._get_default_ssm_launch_config(dstate, is_blackwell)
    return config


def prefill_as_steps(u, ssm_states, delta, A, B, C, D, z, delta_bias, delta_softplus, query_start_loc,
                     cache_indices, has_initial_state, step):
    """The varlen prefill of selective_scan_fn's layouts (u, delta, z [dim, tokens], B/C [N, tokens]) through
    step(state, x, dt, A, B, C, D, dt_bias, z=, dt_softplus=, state_batch_indices=, dst_state_batch_indices=, out=),
    the decode kernel, one position at a time over the sequences that reach it. Writes the output into z and
    returns it, as selective_scan_fn does."""
    import torch

    dev = u.device
    qsl = [int(v) for v in query_start_loc.tolist()]
    slots = [int(v) for v in cache_indices.reshape(-1).tolist()]
    starts = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    fresh = [s for s, cont in zip(slots, starts) if not cont]
    if fresh:
        ssm_states[torch.tensor(fresh, device=dev)] = 0
    rows = lambda t: t.transpose(0, 1)  # noqa: E731  token-major, as the decode receives them
    x_all, dt_all, B_all, C_all, z_all = rows(u), rows(delta), rows(B), rows(C), rows(z)
    lengths = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    for t in range(max(lengths, default=0)):
        live = [i for i, n in enumerate(lengths) if n > t]
        at = torch.tensor([qsl[i] + t for i in live], device=dev)
        lines = torch.tensor([slots[i] for i in live], dtype=cache_indices.dtype, device=dev)
        x_t = x_all[at]
        out = torch.empty_like(x_t)
        step(ssm_states, x_t, dt_all[at], A, B_all[at], C_all[at], D, delta_bias, z=z_all[at],
             dt_softplus=delta_softplus, state_batch_indices=lines, dst_state_batch_indices=lines, out=out)
        z_all[at] = out
    return z


def _steps(original):
    @functools.wraps(original)
    def selective_scan_fn(u, ssm_states, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          query_start_loc=None, cache_indices=None, has_initial_state=None, null_block_id=0,
                          block_size=1024, block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                          initial_state_idx=None, cu_chunk_seqlen=None, last_chunk_indices=None):
        import importlib

        if block_idx_first_scheduled_token is not None or initial_state_idx is not None:
            raise RuntimeError(f"patch {NAME}: prefix caching of Mamba states (mamba_cache_mode all) is not "
                               "covered; turn it off or drop the patch")
        if query_start_loc is None or z is None or cache_indices is None:
            raise RuntimeError(f"patch {NAME}: a Mamba-1 prefill outside MambaMixer's varlen path (query_start_loc, "
                               "cache_indices and the gate z) is not covered")
        step = importlib.import_module(_MIXER).selective_state_update  # the decode's own entry
        return prefill_as_steps(u, ssm_states, delta, A, B, C, D, z, delta_bias, delta_softplus, query_start_loc,
                                cache_indices, has_initial_state, step)
    return selective_scan_fn


PATCH = Patch(
    name=NAME, target="vllm", versions=">=0.26.0,<0.27", gate="C4",
    symptom="C4 (and C5) fails in a Mamba-1 mixer (MambaMixer: Mamba, FalconMamba, Jamba): a decoded token differs "
            "from the same token prefilled; vLLM prefills with selective_scan_fn and decodes with "
            "selective_state_update",
    fix="a Mamba-1 prefill runs the decode kernel token by token from each sequence's state slot; the decode conv "
        "runs the prefill's conv kernel; the decode kernel's launch config is vLLM's batch-free default",
    guide="guides/ops/recurrent-layers.md",
    cost="not measured: one decode-kernel launch per prompt position per mixer (long prefills are slow)",
    **swap_hooks(NAME, (_MIXER, "selective_scan_fn", _steps, _MIXER),
                 (_MIXER, "causal_conv1d_update", conv_as_prefill, _MIXER),
                 (_SSM, "try_get_optimal_ssm_config", pinned_ssm_config, _SSM)),
)
