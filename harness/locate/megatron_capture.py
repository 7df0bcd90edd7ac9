"""The locator's capture runner over the Megatron train engine (tic.harness.engines.megatron.MegatronEngine), under
the checkpoint's module names.

The other side of a comparison (an HF or vLLM rollout) names its modules as transformers does
(model.layers.N.self_attn, ...mlp, ...post_attention_layernorm); the GPTModel holds the same weights under Megatron's
names (decoder.layers.N.self_attention, ...mlp, ...pre_mlp_layernorm). The runner presents each Megatron module
under the HF name the converter's name map gives it (MegatronCausalLM.hf_named_modules, by
tic.harness.model.megatron_convert.module_map); a Megatron module without a counterpart (the bias-dropout-add slots,
the fused q/k/v weight holder) keeps its own name.

Layouts: Megatron's block and layers hand their submodules hidden states sequence-first [T, B, H]; those modules'
tensors are recorded, compared, replayed and traced through their [B, T, H] view. tic's leaves inside them (the
q/k norms) and the word embedding are batch-first already, as in the HF engine.
Residual stream: a hidden-state norm computes add+RMSNorm of the pair its input was summed from
(tic.harness.kernels.modules.ResidualStream). Its input is recorded as that pair, the way transformers' wrapped
add-norm is called (hidden, residual=); fed another side's pair, the norm gets the replaced pair back in the stream,
so it runs on the same addends as the other side.
"""

from __future__ import annotations

import torch

from tic.core.errors import TicInputError
from tic.harness.engines.megatron_spec import TicRMSNorm
from tic.harness.locate.capture import HookSet, keyed_values
from tic.harness.locate.hf_capture import HFCaptureRunner, PaddedRows, set_input
from tic.harness.locate.trail import tensors_of


def _addends(got) -> tuple | None:
    """The (hidden, residual) pair a recorded add-norm input was summed from: transformers' wrapped add-norm call
    (keys "0" and "residual", as this runner records its own), or vLLM's (hidden + residual, hidden, residual)."""
    keys = getattr(got, "keys", None)
    if keys and "residual" in keys and len(got) >= 2:
        return got[0], got[keys.index("residual")]
    if not keys and len(got) == 3:
        return got[1], got[2]
    return None


def _stream_value(got) -> torch.Tensor:
    """The residual stream a recorded input row stands for: residual + hidden for transformers' add-norm pair (as
    both trainers add them), else the first row (every engine records the hidden state first; vLLM's add-norm rows
    start with their sum)."""
    keys = getattr(got, "keys", None)
    return got[keys.index("residual")] + got[0] if keys and "residual" in keys else got[0]


class SequenceFirstRows(PaddedRows):
    """The HF engine's padded or packed [B, T] batches (PaddedRows), where Megatron's sequence-first modules (ids in
    `modules`, names in `names`) take and return [T, B, ...] tensors."""

    def __init__(self, modules: set[int], names: set[str]):
        super().__init__()
        self.sequence_first, self.sequence_first_names = modules, names

    def _per_token(self, x) -> bool:
        B, T = self.shape
        return isinstance(x, torch.Tensor) and x.dtype != torch.bool and x.dim() >= 2 and tuple(x.shape[:2]) == (T, B)

    def _inputs(self, args, kwargs) -> list[tuple[str, torch.Tensor]]:
        found = []
        for key, v in keyed_values(args, kwargs):
            items = [(f"{key}.{j}", x) for j, x in enumerate(v)] if isinstance(v, (list, tuple)) else [(key, v)]
            found += [(k, x) for k, x in items if self._per_token(x)]
        return found

    @staticmethod
    def _pair(module, found) -> tuple | None:
        if not (isinstance(module, TicRMSNorm) and module.use_stream and found):
            return None
        return module.shared.stream.pending(found[0][1])

    def inputs(self, module, args, kwargs):
        if id(module) not in self.sequence_first:
            return super().inputs(module, args, kwargs)
        found = self._inputs(args, kwargs)
        pair = self._pair(module, found)
        if pair is not None:
            return [t.transpose(0, 1) for t in pair], ["0", "residual"]
        return [x.transpose(0, 1) for _, x in found], [k for k, _ in found]

    def outputs(self, name, out):
        ts = tensors_of(out)
        if name not in self.sequence_first_names:
            return ts
        return [t.transpose(0, 1) if self._per_token(t) else t for t in ts]

    def trail_inputs(self, module, args, kwargs):
        rest = super().trail_inputs(module, args, kwargs)
        if id(module) not in self.sequence_first:
            return rest
        return [x.transpose(0, 1) for _, x in self._inputs(args, kwargs)] + rest

    def replace(self, module, args, kwargs, repl):
        """The hidden state (the one per-token input of Megatron's layers and their submodules) with the compared
        tokens' rows replaced; a hidden-state norm's pair too, when the recorded rows hold one."""
        if id(module) not in self.sequence_first:
            return super().replace(module, args, kwargs, repl)
        found = self._inputs(args, kwargs)
        rows = [(i, repl[pos]) for i, pos in self.targets() if repl.get(pos) is not None]
        if not found or not rows:
            return args, kwargs
        key, x = found[0]
        T = self.shape[1]
        pair = self._pair(module, found)

        def put(dst: torch.Tensor, i: int, row: torch.Tensor) -> None:
            here = dst.transpose(0, 1)[i // T, i % T]
            if row.numel() == here.numel() and row.is_floating_point() == here.is_floating_point():
                here.copy_(row.reshape(here.shape))

        if pair is not None and all(_addends(got) is not None for _, got in rows):
            hidden, residual = (t.clone() for t in pair)
            for i, got in rows:
                h, r = _addends(got)
                put(hidden, i, h)
                put(residual, i, r)
            new = residual + hidden  # as the residual add computed the input (TicResidualAdd)
            module.shared.stream.put(new, hidden, residual)
        else:
            new = x.clone()
            for i, got in rows:
                put(new, i, _stream_value(got))
        new_args, new_kwargs = list(args), dict(kwargs)
        set_input(new_args, new_kwargs, key, new)
        return tuple(new_args), new_kwargs


class MegatronCaptureRunner(HFCaptureRunner):
    """The HF runner's scoring (the Megatron engine runs the hf engine's micro-batches, padding and packing) over the
    GPTModel, its modules under the checkpoint's names (MegatronCausalLM.hf_named_modules)."""

    def __init__(self, engine, temperature: float = 1.0):
        super().__init__(engine, temperature)
        self.modules = self.model.hf_named_modules()
        self._name = {id(m): n for n, m in self.modules.items()}
        ids = self.model.sequence_first_modules()
        self._sequence_first = (ids, {n for n, m in self.modules.items() if id(m) in ids})

    def stages(self) -> list[str]:
        gpt = self.model.gpt
        return [self._name[id(m)] for m in (gpt.embedding.word_embeddings, *gpt.decoder.layers,
                                            gpt.decoder.final_layernorm)]

    def children(self, name: str) -> list[str]:
        return [self._name[id(c)] for c in self.modules[name].children()]

    def descendants(self, name: str) -> list[str]:
        return [self._name[id(m)] for m in self.modules[name].modules() if m is not self.modules[name]]

    def _hooks(self, spec) -> HookSet:
        return HookSet(self.modules, spec, SequenceFirstRows(*self._sequence_first))

    def decode(self, samples, target, upto, spec, together=False):
        raise TicInputError("the megatron engine trains and scores: it has no decode to capture")
