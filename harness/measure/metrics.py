"""The consistency metrics, exactly as the method defines them.

Per valid token (sampled, inside the response mask): diff = |p_rollout - p_train| on probabilities.
Reported: max, mean, std of diff; the k3 KL estimator (r - 1 - log r, r = p_train / p_rollout); the fraction
of tokens whose logprobs are bitwise equal; and the first mismatch with its distance in ulps.
Pass means every one of them is exactly 0 (and the equal fraction exactly 1). No tolerance anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tic.core.errors import TicInputError
from tic.harness.engines.dump import iter_dump, pair_with_dump

# The names verl users already watch on their dashboards.
VERL_NAMES = {
    "max": "training/rollout_probs_diff_max",
    "mean": "training/rollout_probs_diff_mean",
    "std": "training/rollout_probs_diff_std",
    "k3_kl": "rollout_corr/k3_kl",
}


class NonFiniteLogprob(Exception):
    """NaN or Inf in a compared logprob: a failure with its own message, never a number to average. side: the
    name of the side whose logprob it is ("rollout", "train", ...); sequence: the index of its sequence."""

    def __init__(self, message: str, side: str = "", sequence: int = -1):
        super().__init__(message)
        self.side, self.sequence = side, sequence


@dataclass
class Mismatch:
    sequence: int
    position: int
    rollout: float
    train: float
    ulps: int

    def as_dict(self) -> dict:
        return {"sequence": self.sequence, "position": self.position, "rollout": self.rollout,
                "train": self.train, "ulps": self.ulps}

    def describe(self) -> str:
        return (f"sequence {self.sequence}, response position {self.position}: rollout {self.rollout!r} "
                f"vs train {self.train!r} ({self.ulps} ulp)")


_INT_OF = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
           torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _ordered_int(x: torch.Tensor) -> torch.Tensor:
    """Map floats to integers whose order and spacing follow the floats of x's own dtype (adjacent floats
    differ by 1), so ulps are counted in the dtype the kernel produced."""
    if x.dtype not in _INT_OF:
        x = x.to(torch.float64)
    int_dtype, magnitude = _INT_OF[x.dtype]
    i = x.view(int_dtype).to(torch.int64)
    return torch.where(i < 0, -(i & magnitude), i)


def ulp_distance(a: float, b: float) -> int:
    """Distance in ulps, in float32 units when both values are exactly float32 (the usual logprob dtype)."""
    ta = torch.tensor([a], dtype=torch.float64)
    tb = torch.tensor([b], dtype=torch.float64)
    if torch.equal(ta.float().double(), ta) and torch.equal(tb.float().double(), tb):
        ta, tb = ta.float(), tb.float()
    return int((_ordered_int(ta) - _ordered_int(tb)).abs().item())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality of two float tensors (compared in float64, which holds float32 exactly)."""
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    return a64.view(torch.int64) == b64.view(torch.int64)


def _check_finite(name: str, seq: int, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bad.any():
        pos = int(bad.nonzero()[0, 0])
        raise NonFiniteLogprob(f"{name} logprob is {t[pos].item()} at sequence {seq}, response position {pos}",
                               name, seq)


class LogprobComparison:
    """The metric record built one sequence at a time (memory independent of how many sequences).

    max/mean/std of diff are merged per sequence with Chan's parallel formulas in float64, so all-equal
    logprobs give exactly 0 for each, as the pass condition needs."""

    def __init__(self):
        self.sequences = self.tokens = self.equal = self.equal_sequences = 0
        self.max = 0.0
        self.mean = 0.0
        self.m2 = 0.0
        self.k3_sum = 0.0
        self.first: Mismatch | None = None

    def add(self, r: torch.Tensor, t: torch.Tensor, m: torch.Tensor | None = None) -> None:
        s = self.sequences
        if r.shape != t.shape:
            raise TicInputError(f"length mismatch at sequence {s}: rollout has {r.numel()} logprobs, "
                                f"train has {t.numel()}")
        valid = torch.ones_like(r, dtype=torch.bool) if m is None else m.to(torch.bool)
        if valid.shape != r.shape:
            raise TicInputError(f"mask length mismatch at sequence {s}: {valid.numel()} vs {r.numel()} logprobs")
        idx = valid.nonzero().flatten()
        rv, tv = r[idx], t[idx]
        _check_finite("rollout", s, torch.where(valid, r, 0.0))
        _check_finite("train", s, torch.where(valid, t, 0.0))
        eq = bitwise_equal(rv, tv)
        self.sequences += 1
        self.equal += int(eq.sum())
        self.equal_sequences += int(bool(eq.all()))
        if self.first is None and not bool(eq.all()):
            j = int((~eq).nonzero()[0, 0])
            pos = int(idx[j])
            self.first = Mismatch(s, pos, float(r[pos]), float(t[pos]), ulp_distance(float(r[pos]), float(t[pos])))
        n_b = int(idx.numel())
        if n_b == 0:
            return
        lr, lt = rv.to(torch.float64), tv.to(torch.float64)
        d = (lr.exp() - lt.exp()).abs()
        log_ratio = lt - lr  # log r, r = p_train / p_rollout
        self.k3_sum += float((log_ratio.exp() - 1.0 - log_ratio).sum())
        mean_b = float(d.mean())
        m2_b = float(((d - mean_b) ** 2).sum())
        n_a, n = self.tokens, self.tokens + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * n_a * n_b / n
        self.max = max(self.max, float(d.max()))
        self.tokens = n

    def result(self) -> dict:
        if self.tokens == 0:
            raise TicInputError("no valid tokens to compare (every response is empty or fully masked)")
        out = {
            "tokens": self.tokens,
            "sequences": self.sequences,
            "max": self.max,
            "mean": self.mean,
            "std": math.sqrt(self.m2 / self.tokens) if self.m2 > 0 else 0.0,
            "k3_kl": self.k3_sum / self.tokens,
            "equal_tokens": self.equal,
            "equal_fraction": self.equal / self.tokens,
            "equal_sequences": self.equal_sequences,
            "first_mismatch": self.first.as_dict() if self.first else None,
        }
        out["verl"] = {VERL_NAMES[k]: out[k] for k in VERL_NAMES}
        return out


def compare_logprobs(rollout: list[torch.Tensor], train: list[torch.Tensor],
                     masks: list[torch.Tensor | None] | None = None) -> dict:
    """Compare per-token logprobs of the same sampled tokens. Returns the metric record (all floats exact)."""
    if len(rollout) != len(train):
        raise TicInputError(f"sequence count mismatch: rollout has {len(rollout)}, train has {len(train)}")
    masks = masks if masks is not None else [None] * len(rollout)
    acc = LogprobComparison()
    for r, t, m in zip(rollout, train, masks):
        acc.add(r, t, m)
    return acc.result()


def is_exact_match(m: dict) -> bool:
    """The pass condition for every logprob-consistency gate."""
    return (m["max"] == 0.0 and m["mean"] == 0.0 and m["std"] == 0.0 and m["k3_kl"] == 0.0
            and m["equal_fraction"] == 1.0 and m["first_mismatch"] is None)


def summary(m: dict) -> str:
    return (f"{100 * m['equal_fraction']:.1f}% bitwise-equal of {m['tokens']} tokens, "
            f"max |dp| {m['max']:.3g}, k3 {m['k3_kl']:.3g}")


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare_generation(alone, other) -> dict:
    """One request sampled alone vs elsewhere (in a batch). Tokens are compared up to the first divergence;
    each compared position is equal only if the token and its logprob bits are both equal."""
    a_ids, o_ids = list(alone.response_ids), list(other.response_ids)
    n = min(len(a_ids), len(o_ids))
    a_lp, o_lp = alone.logprobs[:n], other.logprobs[:n]
    _check_finite("alone", 0, a_lp)
    _check_finite("batched", 0, o_lp)
    eq = bitwise_equal(a_lp, o_lp) & torch.tensor([a_ids[i] == o_ids[i] for i in range(n)], dtype=torch.bool)
    token_div = next((i for i in range(n) if a_ids[i] != o_ids[i]), None)
    compared = n if token_div is None else token_div + 1  # after a different token the histories differ
    eq = eq[:compared]
    first = None
    if not bool(eq.all()):
        j = int((~eq).nonzero()[0, 0])
        first = {"position": j, "alone": float(a_lp[j]), "batched": float(o_lp[j]),
                 "ulps": ulp_distance(float(a_lp[j]), float(o_lp[j])),
                 "alone_token": a_ids[j], "batched_token": o_ids[j]}
    return {"compared": compared, "equal": int(eq.sum()), "identical": first is None and len(a_ids) == len(o_ids),
            "token_divergence": token_div, "first_mismatch": first}


def compare_dump_files(rollout_path: Path, train_path: Path) -> dict:
    """C5's metric record from two dump files, both read one line at a time."""
    rollout_path, train_path = Path(rollout_path), Path(train_path)
    if rollout_path.is_file() and train_path.is_file() and rollout_path.samefile(train_path):
        raise TicInputError(f"rollout and train dumps are the same file ({rollout_path}); a file compared with "
                            "itself proves nothing")
    acc = LogprobComparison()
    for r, t in pair_with_dump(iter_dump(rollout_path), train_path, f"train dump {train_path.name}"):
        acc.add(r.logprobs, t.logprobs, r.mask)
    return acc.result()
