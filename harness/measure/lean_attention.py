"""Eager attention for C7's float32 reference whose scores autograd does not keep between forward and backward.

C7 runs the reference on whole rollout sequences. Eager attention keeps, for backward, each layer's softmax output:
heads x positions^2 float32 values, about 2.6 GiB per layer for 32 heads over a 4,608-token row, so a real-shape
cut's reference holds several of them at the loss. Here each call runs the model's own `eager_attention_forward`
under activation checkpointing: autograd keeps q, k, v and the mask, and backward recomputes one layer's scores at a
time. The recompute is the same function on the same inputs, so the values and gradients are eager attention's.
"""

from __future__ import annotations

import sys

from torch import nn
from torch.utils.checkpoint import checkpoint

LEAN_ATTENTION = "tic_lean_eager"  # the name it is registered under in transformers' attention interface


def _own_eager(module: nn.Module):
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _checkpointed_eager(module, query, key, value, attention_mask, **kwargs):
    own = _own_eager(module)
    if own is None:
        raise RuntimeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward for C7's "
                           "reference to recompute")

    def scores_recomputed(q, k, v, mask):
        return own(module, q, k, v, mask, **kwargs)[0]

    return checkpoint(scores_recomputed, query, key, value, attention_mask, use_reentrant=False), None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: a class named ...Attention holding a projection of its own."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")
            and any(isinstance(c, nn.Linear) for c in m.children())]


def use_lean_attention(model: nn.Module) -> int:
    """Switch a model running eager attention to the checkpointed eager attention; returns how many attention
    modules take it. 0: nothing switched, the model keeps its attention (not eager, no attention module, or one
    whose modeling file has no eager_attention_forward to run)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    found = attention_modules(model)
    if model.config._attn_implementation != "eager" or not found or any(_own_eager(m) is None for m in found):
        return 0
    AttentionInterface.register(LEAN_ATTENTION, _checkpointed_eager)
    AttentionMaskInterface.register(LEAN_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(LEAN_ATTENTION)
    return len(found)
