"""Block-FP8 in the training forward (method 3.1, 4.1, 4.4): the master weights stay in the model dtype, each
forward runs the provider's FP8 kernels on their block-FP8 copy, backward is straight-through.

`QuantizedCopies` holds the copy of every quantized master weight: the codes and scales the checkpoint stored
(valid while the master weight is the one loaded), or the deployment rule
(tic.harness.model.quantize.quantize_weight_blocks) applied to the master weight once it changed. A change is seen
as autograd's weight guard sees it (tensor version, storage address); the new codes and scales are written into
the tensors already held, so their addresses stay (what a rollout's in-place weight sync relies on).

The two operators, `fp8_linear` and `fp8_moe_experts`, take the master weights as their autograd inputs: the
forward value is the provider's FP8 kernel on the copies, the gradient is the unquantized operator's
(quantization treated as identity). C7 checks it against plain transformers following the FP8 forward
(tic.harness.measure.fp8_reference).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tic.harness.kernels.autograd import Op, _linear_backward, _moe_experts_backward, moe_experts_ref
from tic.harness.model.quantize import (block_size_of, check_block_size, dequantize_weight_blocks,
                                        quantize_weight_blocks, read_block_fp8)


@dataclass
class _Copy:
    name: str
    ref: weakref.ref
    version: int
    ptr: int
    codes: torch.Tensor
    scales: torch.Tensor


class QuantizedCopies:
    """The block-FP8 copy (codes, scales) of each registered master weight, kept while that weight is unchanged."""

    def __init__(self, block: tuple[int, int], checkpoint: Path | None = None):
        """checkpoint: the block-FP8 checkpoint the copies come from (vLLM's kernels read its quantization config)."""
        self.block = check_block_size(block)
        self.checkpoint = checkpoint
        self._copies: dict[int, _Copy] = {}
        self._joined: dict[tuple, tuple] = {}  # weight ids -> (their states, concatenated codes and scales)
        self.requantized = 0  # copies rebuilt from a changed master weight (tests and benchmarks read it)
        self.inputs: dict[str, list] | None = None  # while Ops.capture_inputs runs: parameter name -> its inputs

    def register(self, name: str, w: torch.Tensor, codes: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None):
        """Quantize w (the model's parameter `name`) from now on; (codes, scales) from a checkpoint stand for w as
        it is now (else the rule's)."""
        if codes is None:
            codes, scales = quantize_weight_blocks(w.detach(), self.block)
        self._copies[id(w)] = _Copy(name, weakref.ref(w), w._version, w.data_ptr(), codes.to(w.device),
                                    scales.to(w.device, torch.float32))

    def refresh(self) -> list[str]:
        """Requantize, in place, every copy whose master weight changed (a weight sync); their names."""
        stale = [c for c in self._copies.values() if c.ref() is not None and self._stale(c, c.ref())]
        for c in stale:
            self.get(c.ref())
        return [c.name for c in stale]

    def storage(self) -> dict[str, tuple[int, tuple, str]]:
        """(address, shape, dtype) of every copy's codes and scales, by '<parameter>.fp8_codes' / '.fp8_scales'."""
        return {f"{c.name}.fp8_{part}": (t.data_ptr(), tuple(t.shape), str(t.dtype))
                for c in self._copies.values() for part, t in (("codes", c.codes), ("scales", c.scales))}

    def copies(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Parameter name -> its (codes, scales) as held now."""
        return {c.name: (c.codes, c.scales) for c in self._copies.values()}

    @staticmethod
    def _stale(c: _Copy, w: torch.Tensor) -> bool:
        return c.version != w._version or c.ptr != w.data_ptr()

    def name_of(self, w) -> str | None:
        c = self._entry(w)
        return None if c is None else c.name

    def record_input(self, weights, x: torch.Tensor) -> None:
        if self.inputs is not None:
            for w in weights:
                self.inputs.setdefault(self.name_of(w), []).append(x.detach())

    def covers(self, weights) -> bool:
        return all(self._entry(w) is not None for w in weights)

    def _entry(self, w) -> _Copy | None:
        c = self._copies.get(id(w))
        return c if c is not None and c.ref() is w else None

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w's (codes, scales), requantized in place first when w changed since they were made."""
        c = self._entry(w)
        if self._stale(c, w):
            codes, scales = quantize_weight_blocks(w.detach(), self.block)
            c.codes.copy_(codes)
            c.scales.copy_(scales)
            c.version, c.ptr = w._version, w.data_ptr()
            self.requantized += 1
        return c.codes, c.scales

    def joined(self, weights) -> tuple[torch.Tensor, torch.Tensor]:
        """The copies of projections one GEMM runs over (q/k/v, gate/up), concatenated along N as vLLM's merged
        layers hold them (each shard a whole number of blocks), rebuilt only when one of them changed."""
        parts = [self.get(w) for w in weights]
        if len(parts) == 1:
            return parts[0]
        ids = tuple(id(w) for w in weights)
        state = tuple((self._copies[i].version, self._copies[i].ptr) for i in ids)
        held = self._joined.get(ids)
        if held is None or held[0] != state:
            # normal tensors even when first built inside an inference-mode forward (C5's recompute): the same
            # copies serve the training forwards after it, and the kernel keys its prepared layer by their version
            with torch.inference_mode(False), torch.no_grad():
                cat = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            held = self._joined[ids] = (state, cat)
        return held[1]


# -- the operators ---------------------------------------------------------------------------------------------
def _fp8_linear_kernel(provider, x, *wb, n, quant: QuantizedCopies):
    quant.record_input(wb[:n], x)
    codes, scales = quant.joined(wb[:n])
    biases = wb[n:]
    b = None if biases[0] is None else (biases[0] if n == 1 else torch.cat(biases))
    return provider.fp8_linear(x, codes, scales, b, quant.block, checkpoint=quant.checkpoint)


def _fp8_experts_kernel(provider, x, weights, ids, gate_up, down, quant: QuantizedCopies):
    quant.record_input([gate_up], x)
    (gu_q, gu_s), (d_q, d_s) = quant.get(gate_up), quant.get(down)
    if quant.inputs is None:
        return provider.fp8_moe_experts(x, weights, ids, gu_q, gu_s, d_q, d_s, quant.block)
    # recording: the down projection's input too (SiLU*mul per (token, top-k slot), rows token * top_k + slot)
    out, between = provider.fp8_moe_experts(x, weights, ids, gu_q, gu_s, d_q, d_s, quant.block,
                                            with_intermediate=True)
    if between is not None:
        quant.record_input([down], between)
    return out


FP8_OPS: dict[str, Op] = {op.name: op for op in [
    Op("fp8_linear", _fp8_linear_kernel, backward=_linear_backward),
    Op("fp8_moe_experts", _fp8_experts_kernel, lambda x, w, ids, gu, d, quant: moe_experts_ref(x, w, ids, gu, d),
       _moe_experts_backward),
]}


# -- a block-FP8 checkpoint's weights into an HF model -----------------------------------------------------------
# per-expert checkpoint names -> transformers' fused expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I])
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def _expert_target(params: dict, name: str):
    """(parameter name, expert, half of gate_up or None) for a per-expert checkpoint name, or None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    fused, half = _FUSED[m["proj"]]
    target = f"{m['experts']}.{fused}"
    return (target, int(m["e"]), half) if target in params else None


def unquantized_config(model_dir: Path) -> dict:
    """from_pretrained's config argument for a block-FP8 checkpoint: its config without quantization_config, so
    transformers builds plain linears (attach_checkpoint then fills their master weights); {} for any other."""
    import json

    if block_size_of(json.loads((Path(model_dir) / "config.json").read_text())) is None:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if hasattr(c, "quantization_config"):
            delattr(c, "quantization_config")
    return {"config": config}


@torch.no_grad()
def attach_checkpoint(model: nn.Module, model_dir: Path) -> QuantizedCopies | None:
    """For a block-FP8 checkpoint: set each quantized master weight of `model` (loaded without its quantization)
    to codes * scales in the model's dtype and register the stored codes and scales as its copy. None for a
    checkpoint that is not block-FP8."""
    import json

    block = block_size_of(json.loads((Path(model_dir) / "config.json").read_text()))
    if block is None:
        return None
    quant = QuantizedCopies(block, Path(model_dir))
    params = dict(model.named_parameters())
    experts: dict[str, dict] = {}
    for name, (codes, scales) in read_block_fp8(model_dir).items():
        if name in params:
            w = params[name]
            w.copy_(dequantize_weight_blocks(codes, scales, block, w.dtype))
            quant.register(name, w, codes, scales)
            continue
        target = _expert_target(params, name)
        if target is None:
            raise ValueError(f"{model_dir}: quantized weight {name} matches no parameter of the model")
        pname, e, half = target
        experts.setdefault(pname, {})[(e, half)] = (codes, scales)
    for pname, parts in experts.items():
        _attach_experts(quant, pname, params[pname], parts, block)
    return quant


def _attach_experts(quant: QuantizedCopies, name: str, w: nn.Parameter, parts: dict, block) -> None:
    """One fused expert tensor from its per-expert (and, for gate_up, per-half) checkpoint pairs."""
    E = w.shape[0]
    halves = sorted({h for _, h in parts}, key=lambda h: -1 if h is None else h)
    if len(parts) != E * len(halves):
        raise ValueError(f"{len(parts)} quantized expert weights for a tensor of {E} experts")
    codes = torch.stack([torch.cat([parts[(e, h)][0] for h in halves]) for e in range(E)])
    scales = torch.stack([torch.cat([parts[(e, h)][1] for h in halves]) for e in range(E)])
    if tuple(codes.shape) != tuple(w.shape):  # e.g. experts stored as (in, out): the quantized copy would not fit
        raise ValueError(f"{name}: the model stores these experts as {tuple(w.shape)}, the checkpoint's quantized "
                         f"experts stack to {tuple(codes.shape)} ([experts, out, in]); block-FP8 experts are read "
                         "in that layout only")
    w.copy_(dequantize_weight_blocks(codes, scales, block, w.dtype))
    quant.register(name, w, codes, scales)
