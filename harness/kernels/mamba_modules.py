"""Route HF Mamba-2 mixers (Mamba2Mixer, NemotronHMamba2Mixer) through the kernel wrappers (tic.harness.kernels.mamba).

The patched mixer runs in_proj and out_proj as the wrappers' linear, then per sequence the causal conv and the
chunked scan, then the gated grouped RMSNorm. A sequence is found from the forward's own inputs, which a
pre-hook on the model reads (`SequenceLayout`): the 2-D attention mask says which columns hold tokens (left or
right padding), position ids restarting at 0 say where a packed sequence starts (HF's own torch path would carry
the state across them). Each sequence's conv window and scan state start at zeros, so its chunk boundaries sit
at multiples of chunk_size from its first token whatever row, column or batch it sits in.

Decode: the state a row carries between steps lives on the HF cache object the forward was given (attribute
`_tic_mamba`, one `RowState` per layer and row): the conv's last K-1 inputs, the start state of the current
chunk, and the current chunk's tokens so far (x, B, dt before softplus). A decode step runs the same scan kernel
from that state, so token t's output comes from the same operations whether it was prefilled or decoded (the
module docstring of tic.harness.kernels.mamba says why). HF's own conv_states / ssm_states slots are not used:
they hold the single-step recurrence's state, which this scan does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tic.core.errors import TicInputError
from tic.harness.kernels.autograd import KernelFunction, Ops
from tic.harness.kernels.mamba import MAMBA_OPS

def is_mixer(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("in_proj", "conv1d", "A_log", "dt_bias", "D", "out_proj", "norm")) \
        and isinstance(m.conv1d, nn.Conv1d)


def is_mixer1(m: nn.Module) -> bool:
    """A Mamba-1 (selective scan) mixer: x_proj gives dt, B and C, dt_proj widens dt, A_log is [intermediate, state]
    (MambaMixer, FalconMambaMixer, JambaMambaMixer)."""
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("in_proj", "x_proj", "dt_proj", "out_proj")) \
        and isinstance(getattr(m, "conv1d", None), nn.Conv1d) and getattr(m, "A_log", None) is not None \
        and m.A_log.dim() == 2 and hasattr(m, "D")


def is_scan_mixer(m: nn.Module) -> bool:
    """A Mamba-1 or Mamba-2 mixer (in a decoder layer it sits in the attention's place and returns its output
    alone)."""
    return is_mixer1(m) or is_mixer(m)


def run(ops: Ops, name: str, *tensors, **kw):
    """One Mamba operator through the autograd wrapper; a test's own Ops table may replace it by name."""
    return KernelFunction.apply(ops.table.get(name) or MAMBA_OPS[name], ops, kw, *tensors)


# -- the sequences of one forward ---------------------------------------------------------------------------------
class SequenceLayout:
    """The attention mask (2-D, [B, past + T]) and position ids [B, T] of the forward running now, None outside."""

    def __init__(self):
        self.mask = self.positions = None

    def before(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.mask = mask if isinstance(mask, torch.Tensor) else None
        pos = kwargs.get("position_ids")
        self.positions = pos if isinstance(pos, torch.Tensor) else None

    def after(self, module, args, kwargs, output):
        self.mask = self.positions = None

    def rows(self, B: int, T: int, carried: list) -> list[list[tuple[int, int, int]]]:
        """Per row, its sequences in this forward: (first column, end column, position of the first token). A
        sequence's tokens are contiguous columns (left or right padding, packing); without position ids a row
        continues what it carries (or starts at 0)."""
        mask = self.mask
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < T):
            raise TicInputError(f"mamba mixer: a 2-D attention mask [batch, past + {T}] is needed, got "
                                f"{tuple(mask.shape)}")
        valid = mask[:, -T:].bool().tolist() if mask is not None else [[True] * T for _ in range(B)]
        pos = self.positions
        if pos is not None and tuple(pos.shape[-1:]) != (T,):
            raise TicInputError(f"mamba mixer: position ids of shape {tuple(pos.shape)} for {T} tokens")
        pos = pos.expand(B, T).tolist() if pos is not None else None
        out = []
        for b in range(B):
            seqs: list[list[int]] = []
            for t in range(T):
                if not valid[b][t]:
                    continue
                p = pos[b][t] if pos is not None else None
                if seqs and p != 0 and seqs[-1][1] != t:
                    raise TicInputError(f"mamba mixer: row {b} has padding inside a sequence (column {t})")
                if not seqs or p == 0:
                    first = p if p is not None else (carried[b].length if carried[b] is not None else 0)
                    seqs.append([t, t + 1, first])
                else:
                    seqs[-1][1] = t + 1
            out.append([tuple(q) for q in seqs])
        return out


@dataclass
class RowState:
    """What one row's sequence carries into its next step, for one mixer (module docstring)."""
    length: int  # tokens of the sequence so far
    window: torch.Tensor  # [K-1, conv_dim] the conv's last inputs
    state: torch.Tensor  # [H, P, N] float32, the current chunk's start state
    buf_x: torch.Tensor  # [m, H, P] the current chunk's tokens (m < chunk_size)
    buf_dt: torch.Tensor  # [m, H]
    buf_B: torch.Tensor  # [m, G, N]


def _fresh(mixer, like: torch.Tensor) -> RowState:
    H, P, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    z = lambda *s, dt=like.dtype: torch.zeros(*s, dtype=dt, device=like.device)  # noqa: E731
    return RowState(0, z(mixer.conv_kernel_size - 1, mixer.conv_dim), z(H, P, N, dt=torch.float32), z(0, H, P),
                    z(0, H), z(0, G, N))


def _carried_states(cache, layer_idx: int, B: int) -> list:
    if cache is None:
        return [None] * B
    store = cache.__dict__.setdefault("_tic_mamba", {})
    rows = store.get(layer_idx)
    if rows is None or len(rows) != B:
        rows = store[layer_idx] = [None] * B
    return rows


def _sequence(mixer, ops: Ops, xBC, dt, start: RowState):
    """(y float32 [n, H, P], the RowState after it) of one sequence's tokens xBC [n, conv_dim], dt [n, H]."""
    I, G, N = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
    H, P, n = mixer.num_heads, mixer.head_dim, xBC.shape[0]
    conv = run(ops, "mamba_conv", xBC, start.window, mixer.conv1d.weight, mixer.conv1d.bias)
    x, B, C = conv.split([I, G * N, G * N], dim=-1)
    x, B, C = x.reshape(n, H, P), B.reshape(n, G, N), C.reshape(n, G, N)
    lo, hi = (float(v) for v in getattr(mixer, "time_step_limit", (0.0, float("inf"))))
    y, state = run(ops, "mamba_scan", x, dt, B, C, mixer.A_log, mixer.dt_bias, mixer.D, start.state, start.buf_x,
                   start.buf_dt, start.buf_B, chunk_size=int(mixer.chunk_size), dt_min=lo, dt_max=hi)
    K, Q = mixer.conv_kernel_size, int(mixer.chunk_size)
    window = torch.cat([start.window, xBC.detach()])[xBC.shape[0]:] if K > 1 else start.window
    total = start.buf_x.shape[0] + n
    keep = total % Q
    buf = [torch.cat([old, new.detach()])[total - keep:] for old, new in
           ((start.buf_x, x), (start.buf_dt, dt), (start.buf_B, B))]
    return y, RowState(start.length + n, window, state.detach(), *buf)


def _each_sequence(mixer, hidden_states, cache, width: int, dtype, fresh, one) -> torch.Tensor:
    """[B, T, width] in dtype: per row, each of its sequences (module docstring) through one(b, c0, c1, start) ->
    (y [c1 - c0, ...], the state after it), zeros at padding columns; starts from fresh(mixer, hidden_states) or
    the state the cache carries, and keeps the new one there."""
    Bsz, T, _ = hidden_states.shape
    carried = _carried_states(cache, mixer.layer_idx, Bsz)
    rows = []
    for b, seqs in enumerate(mixer._tic_layout.rows(Bsz, T, carried)):
        pieces, col = [], 0
        for c0, c1, first in seqs:
            start = carried[b] if first > 0 else fresh(mixer, hidden_states)
            if start is None or start.length != first:
                raise TicInputError(f"mamba mixer (layer {mixer.layer_idx}): row {b} continues a sequence at "
                                    f"position {first}, but the cache carries {start.length if start else 'nothing'}")
            y, state = one(b, c0, c1, start)
            # pieces in column order (padding zeros): the locator follows each token's values through a cat
            pieces += [hidden_states.new_zeros(c0 - col, width, dtype=dtype), y.reshape(c1 - c0, width)]
            col = c1
            if cache is not None:
                carried[b] = state
        rows.append(torch.cat(pieces + [hidden_states.new_zeros(T - col, width, dtype=dtype)]))
    return torch.stack(rows)


def _given_cache(cache, cache_params, kwargs: dict):
    """The cache HF hands a mixer: as `cache` (5.2x), `cache_params`, or `past_key_values`."""
    return cache if cache is not None else cache_params if cache_params is not None else \
        kwargs.get("past_key_values")


def _mixer_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """The mixer on the wrappers (module docstring); HF passes the cache as `cache` (5.2x) or `cache_params`."""
    cache = _given_cache(cache, cache_params, kwargs)
    ops: Ops = self._tic_ops
    I, H = self.intermediate_size, self.num_heads
    proj = self.in_proj(hidden_states)
    gate, xBC, dt = proj.split([I, self.conv_dim, H], dim=-1)
    y = _each_sequence(self, hidden_states, cache, I, torch.float32, _fresh,
                       lambda b, c0, c1, start: _sequence(self, ops, xBC[b, c0:c1], dt[b, c0:c1], start))
    normed = run(ops, "gated_rms_norm", y, gate, self.norm.weight, group_size=norm_group_size(self.norm),
                 eps=float(self.norm.variance_epsilon), out_dtype=hidden_states.dtype)
    return self.out_proj(normed)


# -- Mamba-1 -------------------------------------------------------------------------------------------------------
@dataclass
class RowState1:
    """What one row's sequence carries into its next step, for one Mamba-1 mixer: the scan's state is exact at
    every token, so the state after the last token (no chunk buffers)."""
    length: int
    window: torch.Tensor  # [K-1, I] the conv's last inputs
    state: torch.Tensor  # [I, N] float32


SCAN_INPUT_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def _scan_input_norm(ops: Ops, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm of dt, B or C: Jamba's has a weight, FalconMamba's none (a weight of ones, exact in the product;
    its buffer of ones is sized for another width)."""
    w = norm.weight if isinstance(norm.weight, nn.Parameter) else torch.ones(x.shape[-1], dtype=x.dtype,
                                                                              device=x.device)
    return ops.rms_norm(x, w, float(norm.variance_epsilon))


def _fresh1(mixer, like: torch.Tensor) -> RowState1:
    I, N, K = mixer.intermediate_size, mixer.ssm_state_size, mixer.conv_kernel_size
    return RowState1(0, torch.zeros(K - 1, I, dtype=like.dtype, device=like.device),
                     torch.zeros(I, N, dtype=torch.float32, device=like.device))


def _sequence1(mixer, ops: Ops, u, z, start: RowState1):
    """(y [n, I] in the model dtype, the RowState1 after it) of one sequence's conv inputs u and gate z [n, I]."""
    R, N = mixer.time_step_rank, mixer.ssm_state_size
    conv = run(ops, "mamba_conv", u, start.window, mixer.conv1d.weight, mixer.conv1d.bias)
    dt, B, C = mixer.x_proj(conv).split([R, N, N], dim=-1)
    norms = [getattr(mixer, n, None) for n in SCAN_INPUT_NORMS]
    if all(n is not None for n in norms):  # Jamba, FalconMamba: RMSNorms on dt, B and C
        dt, B, C = (_scan_input_norm(ops, n, t) for n, t in zip(norms, (dt, B, C)))
    dt = ops.linear(dt, [mixer.dt_proj.weight])  # its bias joins dt inside the scan, before softplus
    y, state = run(ops, "mamba1_scan", conv, dt, B, C, z, mixer.A_log, mixer.D, mixer.dt_proj.bias, start.state)
    K = mixer.conv_kernel_size
    window = torch.cat([start.window, u.detach()])[u.shape[0]:] if K > 1 else start.window
    return y, RowState1(start.length + u.shape[0], window, state.detach())


def _mixer1_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """A Mamba-1 mixer on the wrappers: in_proj, per sequence the causal conv and the selective scan (gated by
    silu(z) inside it), out_proj; sequences and carried state as the Mamba-2 mixer's (module docstring)."""
    cache = _given_cache(cache, cache_params, kwargs)
    ops: Ops = self._tic_ops
    u, z = self.in_proj(hidden_states).chunk(2, dim=-1)
    y = _each_sequence(self, hidden_states, cache, self.intermediate_size, u.dtype, _fresh1,
                       lambda b, c0, c1, start: _sequence1(self, ops, u[b, c0:c1], z[b, c0:c1], start))
    return self.out_proj(y)


def mixer1_problems(m: nn.Module) -> list[str]:
    """What of this Mamba-1 mixer the wrapper does not implement."""
    problems = []
    if getattr(m, "activation", "silu") not in ("silu", "swish"):
        problems.append(f"conv activation {m.activation} (the wrapper runs SiLU)")
    if m.in_proj.out_features != 2 * m.intermediate_size:
        problems.append(f"in_proj of {m.in_proj.out_features} features (the wrapper splits conv input | gate)")
    norms = [getattr(m, n, None) for n in SCAN_INPUT_NORMS]
    rms = [n is not None and type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms]
    if any(n is not None for n in norms) and not all(rms):
        problems.append("norms on dt, B and C other than an RMSNorm on each of the three (the wrapper runs "
                        "Jamba's and FalconMamba's)")
    if m.dt_proj.bias is None:
        problems.append("dt_proj without a bias (the scan adds it before softplus)")
    return problems


def norm_group_size(norm: nn.Module) -> int:
    """The width each RMS statistic covers: the norm's groups, or its whole width where it has none (transformers
    before 5.2x normalized Mamba-2's gated output over all of it, whatever n_groups; vLLM groups it by n_groups, so
    such a checkpoint's two sides compute different functions when n_groups > 1 and C5 shows it)."""
    return int(getattr(norm, "group_size", None) or norm.weight.shape[-1])


# -- coverage and installation -------------------------------------------------------------------------------------
def mixer_problems(m: nn.Module) -> list[str]:
    """What of this mixer the wrapper does not implement (tic.harness.kernels.coverage names the module)."""
    problems = []
    if getattr(m, "activation", "silu") not in ("silu", "swish"):
        problems.append(f"conv activation {m.activation} (the wrapper runs SiLU)")
    want = m.intermediate_size + m.conv_dim + m.num_heads
    if m.in_proj.out_features != want:
        problems.append(f"in_proj of {m.in_proj.out_features} features (the wrapper splits gate | conv input | dt "
                        f"= {want}; an extra MLP branch is not covered)")
    if getattr(m.norm, "weight", None) is None or not hasattr(m.norm, "variance_epsilon"):
        problems.append(f"norm {type(m.norm).__name__} without a weight and variance_epsilon (the wrapper runs the "
                        f"gated RMSNorm)")
    return problems


def install(model: nn.Module) -> SequenceLayout | None:
    """The layout the model's mixers read, fed by hooks on the model's forward; None for a model without mixers."""
    if not any(is_scan_mixer(m) for m in model.modules()):
        return None
    layout = SequenceLayout()
    model.register_forward_pre_hook(layout.before, with_kwargs=True)
    model.register_forward_hook(layout.after, with_kwargs=True)
    return layout


def wrap_mixer(m: nn.Module, layout: SequenceLayout) -> None:
    import types

    m._tic_layout = layout
    m.forward = types.MethodType(_mixer1_forward if is_mixer1(m) else _mixer_forward, m)
