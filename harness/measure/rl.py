"""A minimal RL loop for C8/C9: policy-gradient updates on a synthetic reward, in-place weight sync into the
rollout engine, and training checkpoints (model + optimizer state) that restore bit for bit.

The training forward is plain torch autograd through the train engine's model in its padded layout; the
loss is REINFORCE with a mean-reward baseline: -(A_i * sum_t logp_it) / tokens, A_i = r_i - mean(r).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tic.core.errors import TicInputError
from tic.core.fsio import atomic_write_text
from tic.harness.engines.base import Engine, Sample, Sampling
from tic.harness.engines.hf import padded_batch
from tic.harness.measure.metrics import compare_logprobs
from tic.harness.model.quantize import SCALE_SUFFIX


def synthetic_reward(samples: list[Sample]) -> torch.Tensor:
    """A reward with no model behind it: the fraction of even token ids in the response (deterministic,
    varies across responses, so the advantage is not zero)."""
    return torch.tensor([sum(t % 2 == 0 for t in s.response_ids) / max(len(s.response_ids), 1) for s in samples],
                        dtype=torch.float32)


def response_logprobs(engine, samples: list[Sample], sampling: Sampling):
    """Differentiable logprob of every response token, micro-batch by micro-batch in the train engine's padded
    layout and sequence order: yields (sample indices, their logprobs). A caller that runs backward on each
    before taking the next holds one micro-batch's graph at a time (a real shape's long rows do not fit more)."""
    model = engine.model
    for group in engine.micro_batches(len(samples)):
        chunk = [samples[i] for i in group]
        ids, mask, pos, starts = padded_batch([s.ids for s in chunk], engine.padding_side, engine.device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        lps = []
        for b, s in enumerate(chunk):
            P, R = len(s.prompt_ids), len(s.response_ids)
            lp = engine.logprobs_of(logits[b, starts[b] + P - 1: starts[b] + P - 1 + R], sampling.temperature)
            lps.append(lp[torch.arange(R), torch.tensor(s.response_ids)])
        yield list(group), lps


@dataclass
class StepReport:
    version: int
    updates: int  # optimizer.step() calls during this RL step (the method needs exactly 1)
    loss: float
    reward_mean: float
    changed_tensors: int  # weights whose bytes the step changed


class PolicyGradientTrainer:
    """AdamW on the train engine's model. Every optimizer.step() is counted by a hook, so an extra update
    anywhere (a second mini-batch, a retried step) shows in the report."""

    def __init__(self, engine: Engine, lr: float, updates_per_step: int = 1):
        if not hasattr(engine, "model") or not isinstance(engine.model, torch.nn.Module):
            raise TicInputError(f"train engine {engine.name!r} has no torch model to update (C8/C9 need hf)")
        self.engine = engine
        self.model = engine.model
        self.model.requires_grad_(True)
        self.updates_per_step = updates_per_step
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters()], lr=lr, weight_decay=0.0)
        self.version = 0
        self._count = 0
        self.optimizer.register_step_post_hook(lambda *_: self._bump())

    def _bump(self) -> None:
        self._count += 1

    @property
    def optimizer_steps(self) -> int:
        """optimizer.step() calls since this trainer was built (counted by a hook, wherever they come from)."""
        return self._count

    def step(self, samples: list[Sample], sampling: Sampling) -> StepReport:
        # host copies: a second copy of the weights on the GPU is what a real shape's step cannot spare
        before = {k: v.detach().to("cpu", copy=True) for k, v in self.model.named_parameters()}
        start = self._count
        rewards = synthetic_reward(samples)
        adv = rewards - rewards.mean()
        n = len(samples)
        per = -(-n // self.updates_per_step)  # mini-batches: updates_per_step of them
        losses = []
        for j in range(0, n, per):
            idx = list(range(j, min(j + per, n)))
            self.optimizer.zero_grad(set_to_none=True)
            part = [samples[i] for i in idx]
            tokens = sum(len(s.response_ids) for s in part)
            loss = 0.0
            # the mini-batch's loss, its gradient accumulated micro-batch by micro-batch: one optimizer step
            for group, lps in response_logprobs(self.engine, part, sampling):
                piece = -sum(adv[idx[g]] * lp.sum() for g, lp in zip(group, lps)) / max(tokens, 1)
                piece.backward()
                loss += float(piece.detach())
            self.optimizer.step()
            losses.append(loss)
        self.version += 1
        changed = sum(not torch.equal(before[k], v.detach().cpu()) for k, v in self.model.named_parameters())
        return StepReport(self.version, self._count - start, sum(losses) / len(losses), float(rewards.mean()),
                          changed)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the names and layouts a saved checkpoint has (transformers reverts its load-time
        conversions, e.g. fused expert tensors back to one tensor per expert): what an engine that loads
        checkpoints (vLLM) understands. A block-FP8 model's quantized weights go as its checkpoint holds them:
        the codes under the weight's name and the scales as `weight_scale_inv`, requantized from the current
        master weights first (tic.harness.kernels.fp8)."""
        from transformers.modeling_utils import revert_weight_conversion

        quant = getattr(getattr(self.model, "_tic_ops", None), "quant", None)
        if quant is None:
            return revert_weight_conversion(self.model, self.weights())
        quant.refresh()
        copies = quant.copies()
        out = revert_weight_conversion(self.model, {k: v for k, v in self.weights().items() if k not in copies})
        out.update(revert_weight_conversion(self.model, {k: codes for k, (codes, _) in copies.items()}))
        scales = revert_weight_conversion(self.model, {k: s for k, (_, s) in copies.items()})
        out.update({k[: -len(".weight")] + SCALE_SUFFIX: block_grid(k, s, out[k].shape, quant.block)
                    for k, s in scales.items()})
        return out

    def weights_for(self, engine: Engine) -> dict[str, torch.Tensor]:
        """The weights in the form `engine` takes them (its weight_format: module parameters or checkpoint)."""
        if hasattr(self.model, "hf_weights"):  # a trainer that holds them in its own layout (megatron, issue 32)
            return self.model.hf_weights()
        return self.checkpoint_weights() if engine.weight_format == "checkpoint" else self.weights()

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, directory: Path) -> Path:
        """model.safetensors (weights) + optimizer.pt (optimizer state) + trainer.json (version)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()},
                  str(directory / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        atomic_write_text(directory / "trainer.json", json.dumps({"version": self.version}))
        return directory

    def restore(self, directory: Path) -> dict:
        """Load a checkpoint into this trainer's model (in place) and optimizer. Says what it found."""
        from safetensors.torch import load_file

        if not (directory / "model.safetensors").is_file():
            raise TicInputError(f"checkpoint {directory} has no model.safetensors")
        missing, unexpected = self.model.load_state_dict(load_file(str(directory / "model.safetensors")),
                                                         strict=False)
        if unexpected:
            raise TicInputError(f"checkpoint {directory}: weights the model does not have: {unexpected[:3]}")
        opt = directory / "optimizer.pt"
        has_opt = opt.is_file()
        if has_opt:
            self.optimizer.load_state_dict(torch.load(opt, weights_only=True))
        meta = json.loads((directory / "trainer.json").read_text()) if (directory / "trainer.json").is_file() else {}
        self.version = int(meta.get("version", 0))
        return {"version": self.version, "optimizer_state": has_opt, "missing_weights": list(missing)}


def block_grid(name: str, scales: torch.Tensor, codes_shape, block: tuple[int, int]) -> torch.Tensor:
    """`scales` as the [ceil(N / bn), ceil(K / bk)] grid of its weight's codes [N, K]. Reverting a fused tensor's
    conversion (transformers' per-expert split) may drop the scales' size-1 dimensions (transformers 5.17 does for
    a grid one block wide), which a checkpoint loader then reads as another layout; the elements keep their order,
    so only those dimensions come back. Any other difference is an error, never a guess."""
    n, k = codes_shape[-2:]
    grid = (*codes_shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if tuple(scales.shape) == grid:
        return scales
    if [d for d in scales.shape if d != 1] != [d for d in grid if d != 1]:
        raise RuntimeError(f"{name}: scales {tuple(scales.shape)} do not fit the block grid {grid} of its codes")
    return scales.reshape(grid)


@dataclass
class SyncReport:
    version: int
    storage_moved: list[str]  # weights whose data pointer, shape or dtype changed: re-allocated, not copied
    unequal: list[str]  # weights that differ from the trainer's after the sync
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.storage_moved and not self.unequal


def with_rl_engines(rollout: Engine, train: Engine, body) -> tuple[object, str | None]:
    """(body(rollout, train), None), the rollout engine released afterwards (C8/C9 change its weights);
    (None, why) when the rollout engine has no in-place weight sync."""
    try:
        rollout.weight_storage()
    except NotImplementedError as e:
        return None, f"rollout engine cannot sync weights in place: {e}"
    try:
        return body(rollout, train), None
    finally:
        rollout.release()  # a rollout engine shared with other gates gets its original weights back


def sync_weights(trainer: PolicyGradientTrainer, rollout: Engine) -> SyncReport:
    """Copy the trainer's weights into the rollout engine in place; check storage and values afterwards."""
    before = rollout.weight_storage()
    weights = trainer.weights_for(rollout)
    details = rollout.load_weights_inplace(weights, trainer.version)
    after = rollout.weight_storage()
    moved = sorted(k for k in before if after.get(k) != before[k])
    unequal = rollout.unequal_weights(weights)
    return SyncReport(trainer.version, moved, unequal, details)


def rollout_and_recompute(rollout: Engine, train: Engine, prompts: list[list[int]], sampling: Sampling,
                          version: int) -> tuple[list[Sample], list[torch.Tensor], dict]:
    """Sample at the rollout engine's current weights, recompute with the train engine, compare (C5's metric).
    Request ids are offset by the version so every step draws fresh samples."""
    n = len(prompts)
    samples = rollout.generate(prompts, sampling, [version * n + i for i in range(n)])
    with torch.no_grad():
        recompute = train.score(samples, sampling)
    m = compare_logprobs([s.logprobs for s in samples], recompute, [s.mask for s in samples])
    return samples, recompute, m


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone().cpu() for k, v in tensors.items()}, str(path))


def samples_as_tensors(samples: list[Sample], recompute: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rollout and its recompute as named tensors (response ids, rollout and train logprobs per request)."""
    out = {}
    for i, (s, r) in enumerate(zip(samples, recompute)):
        out[f"{i}.response_ids"] = torch.tensor(s.response_ids, dtype=torch.long)
        out[f"{i}.rollout"] = s.logprobs
        out[f"{i}.train"] = r
    return out


def restored_step(rollout: Engine, train: Engine, checkpoint: Path, prompts: list[list[int]], sampling: Sampling,
                  lr: float, out_dir: Path) -> dict:
    """The first RL step after a restore (run in a fresh process by C9): load the checkpoint into the trainer,
    sync the rollout engine in place, rollout -> recompute -> one update. Writes rollout.safetensors (the
    samples and both sides' logprobs) and updated.safetensors (the weights after the update)."""
    trainer = PolicyGradientTrainer(train, lr, 1)
    info = trainer.restore(checkpoint)
    sync = sync_weights(trainer, rollout)
    samples, recompute, m = rollout_and_recompute(rollout, train, prompts, sampling, trainer.version)
    count = trainer.optimizer_steps
    trainer.step(samples, sampling)
    save_tensors(out_dir / "rollout.safetensors", samples_as_tensors(samples, recompute))
    save_tensors(out_dir / "updated.safetensors", trainer.weights())
    return {"restore": info, "sync_ok": sync.ok, "storage_moved": sync.storage_moved, "unequal": sync.unequal,
            "diff": m, "optimizer_updates": trainer.optimizer_steps - count, "version": trainer.version}


def equal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or exist on one side only)."""
    return sorted(k for k in set(a) | set(b)
                  if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k].detach().cpu(), b[k].detach().cpu()))
