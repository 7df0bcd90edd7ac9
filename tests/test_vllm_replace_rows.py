"""vLLM's replay (harness.locate.vllm_capture.replace_rows) substitutes every token-row input of a module call:
positional, keyword, inside a tuple argument (position embeddings), for modules with or without a named signature,
and rows recorded with argument names (the HF runner's InputRows) by name. CPU stand-ins for vLLM modules."""

from __future__ import annotations

import torch
from torch import nn

from tic.harness.locate.capture import InputRows
from tic.harness.locate.vllm_capture import flat_inputs, replace_rows, stable_inputs

N = 4  # token rows of the step
TARGETS = [(1, 7)]  # row 1 of the step holds the compared position 7


class Attention(nn.Module):  # a named signature, called with keywords
    def forward(self, positions, hidden_states, position_embeddings=None, scale=None):
        return hidden_states


class Opaque(nn.Module):  # forward(*args, **kwargs) all the way down: nothing to bind names to
    def forward(self, *args, **kwargs):
        return args[0]


class AddNorm(nn.Module):  # vLLM's CustomOp pattern: forward(*args, **kwargs) -> forward_native(x, residual)
    def forward(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_native(self, x, residual=None):
        return x + residual


def _recorded(module, args, kwargs, pos=7, row=1):
    """The rows the vLLM runner records for `pos` from a call (what `pre` keeps for spec.inputs)."""
    rows, res = flat_inputs(module, args, kwargs, N)
    return {pos: tuple(t[row].clone() for t in stable_inputs(rows, res))}


def _rand(*shape):
    return torch.randn(*shape)


def test_keyword_and_tuple_inputs_are_replaced_at_the_target_row_only():
    m = Attention()
    other = dict(hidden_states=_rand(N, 3), position_embeddings=(_rand(N, 2), _rand(N, 2)))
    repl = _recorded(m, (torch.arange(N),), other)
    h, cos, sin = _rand(N, 3), _rand(N, 2), _rand(N, 2)
    h0 = h.clone()
    args, kwargs = replace_rows(m, (torch.arange(N),), dict(hidden_states=h, position_embeddings=(cos, sin),
                                                           scale=0.5), N, TARGETS, repl)
    assert torch.equal(args[0], torch.arange(N)) and kwargs["scale"] == 0.5
    got_h, (got_cos, got_sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    assert isinstance(kwargs["position_embeddings"], tuple)
    for got, mine, theirs in ((got_h, h, other["hidden_states"]), (got_cos, cos, other["position_embeddings"][0]),
                              (got_sin, sin, other["position_embeddings"][1])):
        assert torch.equal(got[1], theirs[1])  # the compared row: the other side's
        assert torch.equal(got[[0, 2, 3]], mine[[0, 2, 3]])  # batch-mates: untouched
    assert torch.equal(h, h0)  # the caller's tensor is not written


def test_a_module_without_a_named_signature_gets_its_keyword_inputs_replaced():
    m = Opaque()
    other_x, other_extra = _rand(N, 3), _rand(N, 2)
    repl = _recorded(m, (other_x,), dict(extra=other_extra))
    x, extra = _rand(N, 3), _rand(N, 2)
    args, kwargs = replace_rows(m, (x,), dict(extra=extra, flag=True), N, TARGETS, repl)
    assert torch.equal(args[0][1], other_x[1]) and torch.equal(kwargs["extra"][1], other_extra[1])
    assert kwargs["flag"] is True and torch.equal(kwargs["extra"][0], extra[0])


def test_named_rows_replace_the_input_of_the_same_name_and_foreign_names_only_the_hidden_state():
    m = Attention()
    h, cos, sin = _rand(N, 3), _rand(N, 2), _rand(N, 2)
    kw = dict(hidden_states=h, position_embeddings=(cos, sin))
    # rows named like this call's inputs (cos before the hidden state): each goes to its own argument
    mine = InputRows((torch.ones(2), torch.full((3,), 2.0)), ("position_embeddings.0", "hidden_states"))
    _, out = replace_rows(m, (torch.arange(N),), kw, N, TARGETS, {7: mine})
    assert torch.equal(out["hidden_states"][1], torch.full((3,), 2.0))
    assert torch.equal(out["position_embeddings"][0][1], torch.ones(2))
    assert torch.equal(out["position_embeddings"][1], sin)
    # rows of another engine's signature (HF's positional "0"): the hidden state only
    foreign = InputRows((torch.full((3,), 5.0), torch.ones(2)), ("0", "position_embeddings_hf.0"))
    _, out = replace_rows(m, (torch.arange(N),), kw, N, TARGETS, {7: foreign})
    assert torch.equal(out["hidden_states"][1], torch.full((3,), 5.0))
    assert torch.equal(out["position_embeddings"][0], cos) and torch.equal(out["position_embeddings"][1], sin)


def test_add_norm_parts_are_replayed_exactly_passed_by_keyword():
    m = AddNorm()
    ox, orr = _rand(N, 3), _rand(N, 3)
    repl = _recorded(m, (ox,), dict(residual=orr))
    assert len(repl[7]) == 3  # (x + residual, x, residual)
    x, r = _rand(N, 3), _rand(N, 3)
    args, kwargs = replace_rows(m, (x,), dict(residual=r), N, TARGETS, repl)
    assert torch.equal(args[0][1], ox[1]) and torch.equal(kwargs["residual"][1], orr[1])
    assert torch.equal(args[0][0], x[0])


class SequentialLayer(nn.Module):  # vLLM's Llama-style layer: the residual it is handed is part of its stream
    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            hidden_states = hidden_states + residual
            residual = hidden_states
        return 2 * hidden_states, residual


class StreamLayer(nn.Module):  # vLLM's Cohere layer: overwrites its residual, returns (stream, its input)
    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        return residual + 2 * hidden_states, residual


def test_a_layer_that_overwrites_its_residual_is_compared_on_its_stream_alone():
    """A Llama-style layer's stream is hidden + residual on the way in and out; a Cohere-style layer, which assigns
    its residual before reading it, carries the whole stream in hidden_states and returns (stream, its input):
    summing that pair counted the input twice, so every such layer compared wrong at every position."""
    from tic.harness.locate.vllm_capture import FlatRows, overwrites_residual, stable_outputs

    assert overwrites_residual(StreamLayer()) and not overwrites_residual(SequentialLayer())
    assert not overwrites_residual(AddNorm()) and not overwrites_residual(Attention())
    g = torch.Generator().manual_seed(0)
    pos, h, r = torch.arange(N), torch.randn(N, 8, generator=g), torch.randn(N, 8, generator=g)
    for layer, stream_in in ((SequentialLayer(), h + r), (StreamLayer(), h)):
        rows, res = flat_inputs(layer, (pos, h, r), {}, N)
        assert torch.equal(stable_inputs(rows, res)[0], stream_in)
    summed = {name for name, m in (("layers.0", SequentialLayer()), ("layers.1", StreamLayer()))
              if not overwrites_residual(m)}
    rows = FlatRows(lambda n: [(j, j) for j in range(n)], summed, "embed")
    rows.set(torch.arange(N)[None])
    out_seq, out_stream = SequentialLayer()(pos, h, r), StreamLayer()(pos, h, r)
    assert torch.equal(rows.outputs("layers.0", out_seq)[0], out_seq[0] + out_seq[1])
    assert torch.equal(rows.outputs("layers.1", out_stream)[0], 3 * h)
    assert torch.equal(stable_outputs(True, out_stream, N)[0], 4 * h)  # the pair summed: the input counted twice
