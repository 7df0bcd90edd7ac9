"""The locator's capture runner over an HF engine (tic.harness.engines.hf.HFEngine): its two layouts,
teacher-forced, exactly as its generate and score compute them."""

from __future__ import annotations

import torch

from tic.harness.engines.hf import cache_kwargs, packed_row, padded_batch
from tic.harness.locate.capture import (Capture, CaptureSpec, HookSet, RowLayout, keyed_values, model_part,
                                        module_children)
from tic.harness.locate.provenance import token_view
from tic.harness.locate.trail import tensors_of


def _input_tensors(args: tuple, kwargs: dict, batch: int, length: int) -> list[tuple[str, torch.Tensor]]:
    """Every token-row tensor input of a call, positional and keyword, one level into tuples/lists (e.g. the
    (cos, sin) of `position_embeddings`), as (key, tensor), in the order of capture.keyed_values."""
    found = []
    for key, v in keyed_values(args, kwargs):
        for k, x in ([(f"{key}.{j}", x) for j, x in enumerate(v)] if isinstance(v, (list, tuple)) else [(key, v)]):
            if isinstance(x, torch.Tensor) and token_view(x, batch, length) is not None:
                found.append((k, x))
    return found


def set_input(args: list, kwargs: dict, key: str, value: torch.Tensor) -> None:
    head, _, j = key.partition(".")
    holder, name = (args, int(head)) if head.isdigit() else (kwargs, head)
    if j:
        seq = list(holder[name])
        seq[int(j)] = value
        holder[name] = type(holder[name])(seq)
    else:
        holder[name] = value


def _replaced(args: tuple, kwargs: dict, B: int, T: int, targets, repl: dict) -> tuple[tuple, dict]:
    """args/kwargs with the traced sequence's rows of every token-row input replaced by the other side's.

    Rows recorded with their argument keys (InputRows) replace the input of the same argument, whatever it
    is (hidden states, position embeddings, a residual): a module then sees exactly the other side's inputs.
    A row of another shape or dtype family is left as it is (a decode step's mask row is not a prefill's).
    Rows from an engine that records no keys (plain tuples, hidden state first) replace the hidden state only."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for k, (key, x) in enumerate(_input_tensors(args, kwargs, B, T)):
        x = x.clone()
        view = token_view(x, B, T)
        changed = False
        for i, pos in targets:
            got = repl.get(pos)
            if got is None:
                continue
            keys = getattr(got, "keys", None)
            if keys:
                if key not in keys:
                    continue
                row = got[keys.index(key)]
            elif k == 0 and got:
                row = got[0]
            else:
                continue
            here = view[i // T, i % T]
            # the same elements in the same order in another per-token layout (a decode step's [H, 1, D] head
            # rows and a prefill's [H, D]) replace each other
            if row.numel() != here.numel() or row.is_floating_point() != here.is_floating_point():
                continue
            here.copy_(row.reshape(here.shape))
            changed = True
        if changed:
            set_input(new_args, new_kwargs, key, x)
    return tuple(new_args), new_kwargs


class PaddedRows(RowLayout):
    """HF's layouts: a [B, T] batch (left-padded decode steps, right- or left-padded micro-batches) or one packed
    row [1, total]; a tensor holds tokens in any per-token layout tic.harness.locate.provenance.token_view knows
    ([B, T, ...], [B * T, ...], per head). Inputs are recorded with the argument each came from."""

    def view(self, x):
        return token_view(x, *self.shape) if isinstance(x, torch.Tensor) else None

    def inputs(self, module, args, kwargs):
        found = _input_tensors(args, kwargs, *self.shape)
        return [x for _, x in found], [k for k, _ in found]

    def outputs(self, name, out):
        return tensors_of(out)

    def replace(self, module, args, kwargs, repl):
        return _replaced(args, kwargs, *self.shape, self.targets(), repl)


class HFCaptureRunner:
    """Runs an HFEngine's two layouts teacher-forced, exactly as its generate/score compute them."""

    def __init__(self, engine, temperature: float = 1.0):
        self.engine = engine
        self.model = engine.model
        self.temperature = temperature
        self.modules = dict(self.model.named_modules())

    # names
    def layer_names(self) -> list[str]:
        return [n for n, m in self.modules.items()
                if n.count(".") == 2 and n.split(".")[-2] == "layers" and n.split(".")[-1].isdigit()]

    def stages(self) -> list[str]:
        layers = self.layer_names()
        prefix = layers[0].rsplit(".", 2)[0] if layers else "model"
        pre = [n for n in (model_part(self.modules, prefix, "embed_tokens", "Embedding"), f"{prefix}.rotary_emb")
               if n in self.modules]
        post = [n for n in (model_part(self.modules, prefix, "norm", "Norm"), "lm_head") if n in self.modules]
        return pre + layers + post

    def children(self, name: str) -> list[str]:
        return module_children(self.modules, name)

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.modules if n.startswith(name + ".")]

    # runs
    def _hooks(self, spec: CaptureSpec) -> HookSet:
        return HookSet(self.modules, spec, PaddedRows())

    @torch.inference_mode()
    def decode(self, samples, target, upto, spec, together=False) -> Capture:
        from transformers import DynamicCache

        bs = len(samples) if together else self.engine.batch_size
        start = 0 if together else (target // bs) * bs
        batch = samples[start:start + bs]
        tb = target - start
        prompts = [s.prompt_ids for s in batch]
        B, L = len(prompts), max(len(p) for p in prompts)
        dev = self.engine.device
        ids, mask, pos, _ = padded_batch(prompts, "left", dev)  # as HFEngine._generate_batch
        cache = DynamicCache(config=self.model.config)
        P = len(prompts[tb])
        with self._hooks(spec) as hooks:
            step_ids, step_pos = ids, pos
            for step in range(upto + 1):
                rm = torch.full(step_ids.shape, -1, dtype=torch.long)
                if step == 0:
                    rm[tb, L - P:] = torch.arange(P)
                else:
                    rm[tb, 0] = P + step - 1
                hooks.step(rm)
                logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                    **cache_kwargs(self.model, cache), use_cache=True).logits[:, -1]
                lp = self.engine.logprobs_of(logits, self.temperature)
                hooks.capture.logprobs[step] = lp[tb, batch[tb].response_ids[step]].float().cpu().clone()
                nxt = [s.response_ids[step] if step < len(s.response_ids) else 0 for s in batch]
                step_ids = torch.tensor(nxt, dtype=torch.long, device=dev)[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long, device=dev)], dim=1)
        return hooks.capture

    @torch.inference_mode()
    def score(self, samples, target, spec) -> Capture:
        eng = self.engine
        group = next(g for g in eng.micro_batches(len(samples)) if target in g)  # the forward the engine ran
        chunk = [samples[i] for i in group]
        tb = group.index(target)
        seqs = [s.ids for s in chunk]
        with self._hooks(spec) as hooks:
            if eng.packing:  # the layout of HFEngine._score_packed
                ids, pos, offsets = packed_row(seqs, eng.device)
                off = offsets[tb]
                rm = torch.full(ids.shape, -1, dtype=torch.long)
                rm[0, off:off + len(seqs[tb])] = torch.arange(len(seqs[tb]))
                hooks.step(rm)
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            else:  # the layout of HFEngine._score_padded
                ids, mask, pos, starts = padded_batch(seqs, eng.padding_side, eng.device)
                rm = torch.full(ids.shape, -1, dtype=torch.long)
                rm[tb, starts[tb]:starts[tb] + len(seqs[tb])] = torch.arange(len(seqs[tb]))
                hooks.step(rm)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                off = None
            s = chunk[tb]
            P, R = len(s.prompt_ids), len(s.response_ids)
            rows = logits[off + P - 1: off + P - 1 + R] if eng.packing else \
                logits[tb, starts[tb] + P - 1: starts[tb] + P - 1 + R]
            lp = eng.logprobs_of(rows, self.temperature)
            got = lp[torch.arange(R), torch.tensor(s.response_ids)].float().cpu()
            hooks.capture.logprobs = {j: got[j].clone() for j in range(R)}
        return hooks.capture
