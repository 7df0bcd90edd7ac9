"""The locator's capture runner over tic's in-process vLLM engine (tic.harness.engines.vllm.VLLMEngine).

vLLM runs every step as one flat batch of token rows [num_tokens, ...] with a positions tensor; the V1 GPU model
runner's input batch says which rows belong to which request (query_start_loc). A step's rows of the compared
request are mapped to (request, position) when the step starts (a pre-hook on the embedding), and every hooked
module keeps, or replaces, just those rows, keyed by position - the same keys the HF runner uses, so vLLM can be
compared with itself (C3, C4) or with HF (C5) by stable module names.

Stable per-layer values: a vLLM decoder layer takes and returns (hidden, residual) apart; the residual stream HF
carries is hidden + residual (in the model dtype, as the next fused add-RMSNorm forms it). So a layer's (and an
add-norm's) recorded input is (hidden + residual, hidden, residual): HF replays the first, vLLM replays the
two raw parts (exact). Its output is hidden + residual (layers) or the normed value (norms). A layer whose forward
assigns its `residual` parameter before reading it (Cohere's parallel layer: `residual = hidden_states`) takes its
whole stream as hidden_states and returns (stream, its own input): its input and output are the hidden part alone.

Teacher-forced decode: the same seeded requests are rerun in the same batch (vLLM samples per request with its
own seed, so the tokens are reproduced; checked up to the compared position). Scoring step by step with
prompt+prefix would run prefill kernels, not decode, and so would not be the computation the gate measured.
"""

from __future__ import annotations

import dis
import functools
from typing import Any

import torch

from tic.core.errors import TicInputError
from tic.harness.engines.base import Sampling
from tic.harness.engines.vllm import _exact_f32, scored_from_record
from tic.harness.locate.capture import HookSet, RowLayout, model_part, module_children


def _float_rows(x, n: int) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1 and x.shape[0] == n


def _signature(module):
    """The forward's named signature; vLLM's CustomOps (RMSNorm, ...) forward(*args, **kwargs) to forward_native
    & co., whose signature names the parameters (x, residual)."""
    import inspect

    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for attr in ("forward", "forward_native", "forward_cuda"):
        f = getattr(module, attr, None)
        if f is None:
            continue
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            continue
        if not any(p.kind in var for p in sig.parameters.values()):
            return sig
    return None


def overwrites_residual(module) -> bool:
    """Whether the module's forward assigns its `residual` parameter before any read of it: such a layer ignores
    the residual it is handed, and the pair it returns is (stream, input), not (hidden, residual to add)."""
    return _overwrites_residual(type(module))


@functools.cache
def _overwrites_residual(cls) -> bool:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None or "residual" not in code.co_varnames[:code.co_argcount]:
        return False
    for ins in dis.get_instructions(code):
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        if "residual" not in names or "FAST" not in ins.opname:
            continue
        # super-instructions name two locals (STORE_FAST_LOAD_FAST: the store first); take the residual's part
        kind = ins.opname.split("_FAST")[0] if len(names) == 1 else \
            ins.opname.replace("_FAST", "").split("_")[names.index("residual")]
        return kind.endswith("STORE")
    return False


def _bind_call(module, args, kwargs) -> tuple[list[tuple[str, Any]], bool]:
    """(parameter name, value) of a call in the forward's parameter order, and whether the names come from its
    signature; without one (forward(*args, **kwargs) all the way down), positional arguments are named by
    their index ("0", "1", ...) and keyword arguments by their keyword."""
    sig = _signature(module)
    if sig is not None:
        try:
            return list(sig.bind(*args, **kwargs).arguments.items()), True
        except TypeError:
            pass
    return [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items()), False


def _bind(module, args, kwargs) -> list[tuple[str, Any]]:
    return _bind_call(module, args, kwargs)[0]


def flat_inputs(module, args, kwargs, n: int) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """The token-row float inputs of a call [(key, tensor)], and the name of its residual input if it has one.

    Keys name the argument, positional or keyword alike; a tensor inside a tuple/list argument (e.g. the
    (cos, sin) of `position_embeddings`) is keyed "name.j". Top-level arguments come first, in parameter order,
    so the first input is the hidden state as other engines' replays take it."""
    bound = _bind(module, args, kwargs)
    rows = [(k, v) for k, v in bound if _float_rows(v, n)]
    res = "residual" if any(k == "residual" for k, _ in rows) and not overwrites_residual(module) else None
    rows += [(f"{k}.{j}", x) for k, v in bound if isinstance(v, (list, tuple))
             for j, x in enumerate(v) if _float_rows(x, n)]
    return rows, res


def stable_inputs(rows: list[tuple[str, torch.Tensor]], res: str | None) -> list[torch.Tensor]:
    """Per-token input tensors as compared/replayed: (x + residual, x, residual) for add-norm calls."""
    if res is not None and len(rows) == 2:
        x = next(v for k, v in rows if k != res)
        r = next(v for k, v in rows if k == res)
        return [x + r, x, r]
    return [v for _, v in rows]


def stable_outputs(summed: bool, out, n: int) -> list[torch.Tensor]:
    """Per-token output as compared: a layer's hidden + residual where its pair is to be summed (`summed`), else
    the first token-row tensor."""
    if summed and isinstance(out, tuple) and len(out) == 2:
        h, r = out
        return [h if r is None else h + r]
    ts = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, (tuple, list)) else [])
                                                      if isinstance(t, torch.Tensor)]
    ts = [t for t in ts if _float_rows(t, n)]
    return ts[:1]


def _recorded_row(got, key: str, k: int, own_keys: list[str]):
    """The recorded row that replaces input `key` (the call's k-th token-row input), or None.

    Rows that name their arguments (InputRows, e.g. from the HF runner) replace the input of the same name; rows
    whose names match none of this call's inputs (another engine's module signature) replace the hidden state
    (the first input) only. Plain rows (this runner's own records) go by input order, which the same module's
    call gives both sides."""
    keys = getattr(got, "keys", None)
    if keys:
        if key in keys:
            return got[keys.index(key)]
        return got[0] if k == 0 and not any(o in keys for o in own_keys) else None
    return got[k] if k < len(got) else None


def replace_rows(module, args, kwargs, n: int, targets: list[tuple[int, int]], repl: dict) -> tuple[tuple, dict]:
    """args/kwargs with the compared request's rows of every token-row input (positional, keyword, or inside a
    tuple argument) replaced by the other side's recorded rows. A row of another shape is left as it is."""
    bound, named = _bind_call(module, args, kwargs)
    rows, res = flat_inputs(module, args, kwargs, n)
    new = {k: v for k, v in bound}
    if res is not None and len(rows) == 2:
        x_name = next(k for k, _ in rows if k != res)
        xs, rs = new[x_name].clone(), new[res].clone()
        for i, pos in targets:
            got = repl.get(pos)
            if got is None:
                continue
            if len(got) == 3:      # vLLM's own (sum, hidden, residual): replay the two parts exactly
                xs[i], rs[i] = got[1].to(xs.device, xs.dtype), got[2].to(rs.device, rs.dtype)
            else:                  # the residual stream from another engine: hidden = it, residual = 0
                xs[i] = got[0].to(xs.device, xs.dtype)
                rs[i] = 0
        new[x_name], new[res] = xs, rs
    else:
        own = [key for key, _ in rows]
        for k, (key, v) in enumerate(rows):
            v, changed = v.clone(), False
            for i, pos in targets:
                got = repl.get(pos)
                row = None if got is None else _recorded_row(got, key, k, own)
                if row is None or tuple(row.shape) != tuple(v[i].shape):
                    continue
                v[i] = row.to(v.device, v.dtype)
                changed = True
            if not changed:
                continue
            head, _, j = key.partition(".")
            if j:  # a member of a tuple/list argument: a new container of the same type
                seq = list(new[head])
                seq[int(j)] = v
                new[head] = type(new[head])(seq)
            else:
                new[key] = v
    if not named:  # no signature to bind to: positional as given, keywords by keyword
        return tuple(new[str(i)] for i in range(len(args))), {k: new[k] for k in kwargs}
    import inspect

    params = _signature(module).parameters
    pos_names = [p for p in params if params[p].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    out_args = tuple(new[p] for p in pos_names[:len(args)])
    out_kwargs = {k: new[k] for k in new if k not in pos_names[:len(args)]}
    return out_args, out_kwargs


def _step_targets(r, prompt: tuple[int, ...], n: int) -> list[tuple[int, int]]:
    """(row, position) of the compared request's rows in the step of `n` token rows that vLLM's V1 model runner
    `r` is running: its input batch says which rows belong to which request (query_start_loc)."""
    k = r.input_batch.num_reqs
    qsl = r.query_start_loc.np[:k + 1]
    hit = [i for i, rid in enumerate(r.input_batch.req_ids[:k])
           if tuple(int(t) for t in r.requests[rid].prompt_token_ids) == prompt]
    if len(hit) > 1:
        raise RuntimeError("capture: the compared prompt occurs twice in one vLLM step")
    if not hit:
        return []
    a, b = int(qsl[hit[0]]), int(qsl[hit[0] + 1])
    if b > n:
        raise RuntimeError(f"capture: request rows {a}:{b} outside the step's {n} token rows")
    pos = r.positions[a:b].detach().cpu().tolist() if isinstance(r.positions, torch.Tensor) else \
        r.positions.np[a:b].tolist()
    return [(a + j, int(p)) for j, p in enumerate(pos)]


class FlatRows(RowLayout):
    """vLLM's steps: one flat batch of token rows [num_tokens, ...] per step, as a [1, num_tokens] map set by a
    pre-hook on the embedding (`step_targets(n)`: the compared request's (row, position) pairs). A module's
    per-token tensors are its float arguments with one row per token (named by its signature); the output of a
    decoder layer in `summed_layers` is hidden + residual, and an add-norm's input (hidden + residual, hidden,
    residual), recorded unnamed."""

    def __init__(self, step_targets, summed_layers: set[str], step_module: str):
        super().__init__()
        self.step_targets, self.summed_layers, self.step_module = step_targets, summed_layers, step_module

    def step_map(self, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        m = torch.full((1, int(ids.shape[0])), -1, dtype=torch.long)
        for row, pos in self.step_targets(int(ids.shape[0])):
            m[0, row] = pos
        return m

    def view(self, x):
        return x[None] if _float_rows(x, self.shape[1]) else None

    def inputs(self, module, args, kwargs):
        return stable_inputs(*flat_inputs(module, args, kwargs, self.shape[1])), None

    def outputs(self, name, out):
        return stable_outputs(name in self.summed_layers, out, self.shape[1])

    def replace(self, module, args, kwargs, repl):
        return replace_rows(module, args, kwargs, self.shape[1], self.targets(), repl)


class VLLMCaptureRunner:
    """CaptureRunner over a VLLMEngine (in-process, V1 GPU model runner, eager)."""

    def __init__(self, engine, temperature: float = 1.0):
        if engine.opts["enforce_eager"] is not True:
            raise TicInputError("capture on vllm needs rollout.options.enforce_eager: true (CUDA graphs and "
                                "torch.compile replay kernels without running module hooks); `tic locate --eager` "
                                "runs the comparison so, with the same patches")
        if engine.opts.get("engine_process", "inline") != "inline":
            raise TicInputError("capture on vllm needs rollout.options.engine_process: inline (module hooks run "
                                "in the engine core's process)")
        runner = engine.model_runner()
        if not (hasattr(runner, "input_batch") and hasattr(runner, "query_start_loc")):
            raise TicInputError("capture on vllm needs its V1 GPU model runner (per-step request layout); this "
                                "engine runs the V2 runner: set rollout.options.model_runner: v1")
        self.engine, self.runner, self.temperature = engine, runner, temperature
        self.model = engine.model()
        self.modules = dict(self.model.named_modules())
        self.layers = [n for n in self.modules if n.count(".") == 2 and n.split(".")[-2] == "layers"
                       and n.split(".")[-1].isdigit()]
        self.prefix = self.layers[0].rsplit(".", 2)[0] if self.layers else "model"
        self._layer_set = set(self.layers)

    @property
    def repro_setup(self) -> list[str]:
        """vLLM's batch-invariant mode swaps aten kernels (softmax, mean, ...) and cuBLAS settings for the whole
        process, the train side's too: a repro must switch it on the same way before it runs anything."""
        if not self.engine.batch_invariant:
            return []
        return ["import os", "os.environ['VLLM_BATCH_INVARIANT'] = '1'",
                "from vllm.model_executor.layers.batch_invariant import init_batch_invariance",
                "init_batch_invariance()"]

    # names (the same stable names as the HF runner: embed_tokens, layers.<i>, norm; vLLM has no model-level
    # rotary module and computes the head's logits outside a module call on a row subset, so neither is a stage)
    def stages(self) -> list[str]:
        pre = [n for n in (model_part(self.modules, self.prefix, "embed_tokens", "Embedding"),) if n]
        post = [n for n in (model_part(self.modules, self.prefix, "norm", "Norm"),) if n]
        return pre + self.layers + post

    def children(self, name: str) -> list[str]:
        return module_children(self.modules, name)

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.modules if n.startswith(name + ".")]

    def _run(self, prompts, params, kind, rids, probe: int, spec):
        prompt = tuple(int(t) for t in prompts[probe])
        embedding = model_part(self.modules, self.prefix, "embed_tokens", "Embedding")
        if embedding is None:
            raise RuntimeError(f"capture: no token embedding module under {self.prefix} in vLLM's model (the "
                               f"forward step's rows are mapped at its call)")
        summed = {n for n in self._layer_set if not overwrites_residual(self.modules[n])}
        layout = FlatRows(lambda n: _step_targets(self.runner, prompt, n), summed, embedding)
        with HookSet(self.modules, spec, layout) as hooks:
            try:
                recs = self.engine._run(prompts, params, kind, rids)
            except BaseException:
                self.engine.abort_unfinished()
                raise
        return hooks.capture, recs[probe]

    @torch.inference_mode()
    def decode(self, samples, target, upto, spec, together=False):
        eng = self.engine
        sp = getattr(eng, "last_sampling", None)
        if sp is None:
            raise RuntimeError("capture: this vLLM engine has not generated yet (no sampling to rerun)")
        sp = Sampling(temperature=self.temperature, max_tokens=sp.max_tokens, seed=sp.seed)
        bs = len(samples) if together else eng.batch_size
        start = 0 if together else (target // bs) * bs
        batch = samples[start:start + bs]
        tb = target - start
        params = [eng._sampling_params(sp, s.id) for s in batch]
        cap, rec = self._run([s.prompt_ids for s in batch], params, "capture", [s.id for s in batch], tb, spec)
        want = list(batch[tb].response_ids[:upto + 1])
        got = rec["token_ids"][:upto + 1]
        if not spec.replace and got[:upto] != want[:upto]:
            raise RuntimeError(f"capture: vLLM's rerun sampled other tokens than the compared rollout before "
                               f"response position {upto} (rerun not deterministic)")
        for j, tok in enumerate(want):
            d = rec["logprobs"][j] if rec["logprobs"] and j < len(rec["logprobs"]) else None
            if d is not None and j < len(got) and got[j] == tok and str(tok) in d:
                cap.logprobs[j] = _exact_f32([d[str(tok)]], "vLLM capture logprob")[0]
        return cap

    @torch.inference_mode()
    def score(self, samples, target, spec):
        from vllm import SamplingParams

        eng = self.engine
        bs = eng.batch_size
        start = (target // bs) * bs
        chunk = samples[start:start + bs]
        tb = target - start
        params = [SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                 ignore_eos=True) for _ in chunk]
        cap, rec = self._run([s.ids for s in chunk], params, "capture-score", [s.id for s in chunk], tb, spec)
        got = scored_from_record(rec, len(chunk[tb].prompt_ids))
        cap.logprobs = {j: got[j].clone() for j in range(len(got))}
        return cap
