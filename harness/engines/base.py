"""What every engine returns: sampled responses with the logprob of each sampled token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One request: prompt and sampled response token ids, and one logprob per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: torch.Tensor  # float32 (live engines) or float64 (dumps), shape [len(response_ids)]
    mask: torch.Tensor | None = None  # bool, True = valid token (inside the response mask)
    weight_version: int | None = None
    id: str | int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)


def request_seed(seed: int, request_id: int) -> int:
    """Every engine's per-request sampler seed: a function of the request alone, so batch-mates cannot shift it."""
    return (seed * 1_000_003 + int(request_id)) % (1 << 63)


@dataclass
class Sampling:
    temperature: float = 1.0
    max_tokens: int = 16
    seed: int = 0


class Engine:
    """Interface. Rollout engines implement generate + score; train engines implement score.
    RL gates (C8, C9) also need weight sync into the rollout engine, in place."""

    name = "engine"
    weight_version: int = 0
    # fingerprint() keys and env vars that are the consistency switch: the only things C10 lets differ
    # between the baseline and the consistent rollout
    switch_keys: tuple[str, ...] = ()
    switch_env: tuple[str, ...] = ()

    def generate(self, prompts: list[list[int]], sampling: Sampling, request_ids: list[int]) -> list[Sample]:
        """Sample responses; request_ids seed each request's sampler, so batch-mates cannot change it."""
        raise NotImplementedError(f"engine {self.name!r} does not generate")

    def generate_together(self, prompts: list[list[int]], sampling: Sampling, request_ids: list[int]) -> list[Sample]:
        """Like generate, but the requests must share one batch (C3 places a probe among batch-mates)."""
        return self.generate(prompts, sampling, request_ids)

    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        """Logprob of every response token from one whole-sequence forward (teacher forcing)."""
        raise NotImplementedError(f"engine {self.name!r} does not score")

    def dumped_samples(self) -> list[Sample] | None:
        """Engines that replay recorded data (dumps) return it here; live engines return None."""
        return None

    # -- C1/C10 ---------------------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """What this engine runs with that changes numerics or speed (kernels, backend, batch sizes)."""
        return {"engine": self.name}

    def process_environment(self) -> dict:
        """For an engine running in a process of its own: {"env": the variables it started with, "patches": the
        patches active there}; {} when it runs in this process (its environment is this process's)."""
        return {}

    @classmethod
    def perf_changes(cls, side_cfg) -> dict:
        """Side-config changes every C1/C10 side runs with (both sides alike), e.g. a process of its own."""
        return {}

    @classmethod
    def baseline_changes(cls, side_cfg) -> dict:
        """The side-config changes that turn the consistency switch off (the baseline's rollout)."""
        raise NotImplementedError(f"engine {cls.name!r} has no consistency switch to turn off")

    # -- the locator ----------------------------------------------------------------------------------------
    @classmethod
    def capture_changes(cls, side_cfg) -> dict:
        """The side-config changes under which the locator's module hooks see every forward (e.g. no compiled
        code or CUDA graphs, which replay kernels without running hooks); {} where the side runs so already."""
        return {}

    # -- C8/C9: weight sync ---------------------------------------------------------------------------------
    weight_format = "module"  # what load_weights_inplace takes: "module" parameter names, or "checkpoint" ones
    def load_weights_inplace(self, weights, version: int) -> dict:
        """Copy (name, tensor) pairs into this engine's existing weight storage (never re-allocate: CUDA
        graphs keep the addresses they captured), recompute weight-derived tensors, set weight_version."""
        raise NotImplementedError(f"engine {self.name!r} has no in-place weight sync")

    def weight_storage(self) -> dict[str, tuple[int, tuple, str]]:
        """name -> (data pointer, shape, dtype) of every weight: C8 checks a sync left them unchanged."""
        raise NotImplementedError(f"engine {self.name!r} does not expose its weight storage")

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as this engine holds them (C8 checks they equal the trainer's after a sync)."""
        raise NotImplementedError(f"engine {self.name!r} does not expose its weights")

    def unequal_weights(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """The weights of this engine that are not bitwise what `weights` (the trainer's, by its names) give;
        an engine that stores them under its own names and layouts (fused, sharded) overrides this."""
        have = self.named_weights()
        return sorted(k for k, v in weights.items()
                      if k not in have or not torch.equal(have[k].detach().cpu(), v.detach().cpu()))

    def release(self) -> None:
        """Give back what a gate's private use changed (C8/C9 change a rollout engine's weights)."""
