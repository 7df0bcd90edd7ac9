"""The locator's capture runner over an HF engine (tic.harness.engines.hf.HFEngine): its two layouts,
teacher-forced, exactly as its generate and score compute them."""

from __future__ import annotations

import torch

from tic.harness.engines.hf import cache_kwargs, packed_row, padded_batch
from tic.harness.locate.capture import Capture, CaptureSpec, HookSet, _RowMap


class HFCaptureRunner:
    """Runs an HFEngine's two layouts teacher-forced, exactly as its generate/score compute them."""

    def __init__(self, engine, temperature: float = 1.0):
        self.engine = engine
        self.model = engine.model
        self.temperature = temperature
        self.modules = dict(self.model.named_modules())
        self.rowmap = _RowMap()

    # names
    def layer_names(self) -> list[str]:
        return [n for n, m in self.modules.items()
                if n.count(".") == 2 and n.split(".")[-2] == "layers" and n.split(".")[-1].isdigit()]

    def stages(self) -> list[str]:
        layers = self.layer_names()
        prefix = layers[0].rsplit(".", 2)[0] if layers else "model"
        pre = [n for n in (f"{prefix}.embed_tokens", f"{prefix}.rotary_emb") if n in self.modules]
        post = [n for n in (f"{prefix}.norm", "lm_head") if n in self.modules]
        return pre + layers + post

    def children(self, name: str) -> list[str]:
        return [f"{name}.{c}" if name else c for c, _ in self.modules[name].named_children()]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.modules if n.startswith(name + ".")]

    # runs
    def _hooks(self, spec: CaptureSpec) -> HookSet:
        return HookSet(self.modules, spec, self.rowmap)

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
                self.rowmap.set(rm)
                logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                    **cache_kwargs(self.model, cache), use_cache=True).logits[:, -1]
                hooks.capture.forwards += 1
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
                self.rowmap.set(rm)
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            else:  # the layout of HFEngine._score_padded
                ids, mask, pos, starts = padded_batch(seqs, eng.padding_side, eng.device)
                rm = torch.full(ids.shape, -1, dtype=torch.long)
                rm[tb, starts[tb]:starts[tb] + len(seqs[tb])] = torch.arange(len(seqs[tb]))
                self.rowmap.set(rm)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                off = None
            hooks.capture.forwards += 1
            s = chunk[tb]
            P, R = len(s.prompt_ids), len(s.response_ids)
            rows = logits[off + P - 1: off + P - 1 + R] if eng.packing else \
                logits[tb, starts[tb] + P - 1: starts[tb] + P - 1 + R]
            lp = eng.logprobs_of(rows, self.temperature)
            got = lp[torch.arange(R), torch.tensor(s.response_ids)].float().cpu()
            hooks.capture.logprobs = {j: got[j].clone() for j in range(R)}
        return hooks.capture
