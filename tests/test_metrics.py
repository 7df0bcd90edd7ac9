"""The diff metric against an independent computation (numpy, float64)."""

import math

import numpy as np
import pytest
import torch

from tic.harness.measure.metrics import NonFiniteLogprob, compare_logprobs, is_exact_match, ulp_distance


def independent(r, t):
    r = np.concatenate([np.asarray(x, dtype=np.float64) for x in r])
    t = np.concatenate([np.asarray(x, dtype=np.float64) for x in t])
    d = np.abs(np.exp(r) - np.exp(t))
    lr = t - r
    k3 = np.exp(lr) - 1 - lr
    return d.max(), d.mean(), d.std(), k3.mean(), float(np.mean(r.view(np.int64) == t.view(np.int64)))


def test_identical_is_exact_zero():
    x = [torch.tensor([-1.5, -0.25, -3.0]), torch.tensor([-0.1])]
    m = compare_logprobs(x, [y.clone() for y in x])
    assert is_exact_match(m)
    assert m["max"] == m["mean"] == m["std"] == m["k3_kl"] == 0.0 and m["equal_fraction"] == 1.0


def test_metrics_match_numpy():
    g = torch.Generator().manual_seed(1)
    r = [-torch.rand(7, generator=g) * 5 for _ in range(3)]
    t = [x + torch.randn(7, generator=g) * 1e-3 for x in r]
    t[0][2] = r[0][2]  # one exact match
    m = compare_logprobs(r, t)
    mx, mean, std, k3, eq = independent(r, t)
    assert m["max"] == pytest.approx(mx, rel=1e-12)
    assert m["mean"] == pytest.approx(mean, rel=1e-12)
    assert m["std"] == pytest.approx(std, rel=1e-12)
    assert m["k3_kl"] == pytest.approx(k3, rel=1e-9)
    assert m["equal_fraction"] == eq
    assert not is_exact_match(m)
    assert m["verl"]["training/rollout_probs_diff_max"] == m["max"]


def test_one_ulp_is_found_and_named():
    r = [torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float32)] * 2
    t = [r[0].clone(), r[1].clone()]
    t[1][2] = torch.nextafter(t[1][2], torch.tensor(0.0))
    m = compare_logprobs(r, t)
    assert m["first_mismatch"]["sequence"] == 1 and m["first_mismatch"]["position"] == 2
    assert m["first_mismatch"]["ulps"] == 1
    assert m["equal_tokens"] == 5 and m["max"] > 0
    assert not is_exact_match(m)


def test_mask_excludes_tokens():
    r = [torch.tensor([-1.0, -2.0])]
    t = [torch.tensor([-1.0, -9.0])]
    assert is_exact_match(compare_logprobs(r, t, [torch.tensor([True, False])]))
    assert not is_exact_match(compare_logprobs(r, t, [None]))


def test_nan_is_its_own_failure():
    with pytest.raises(NonFiniteLogprob, match="nan"):
        compare_logprobs([torch.tensor([-1.0, math.nan])], [torch.tensor([-1.0, -1.0])])
    with pytest.raises(NonFiniteLogprob, match="inf"):
        compare_logprobs([torch.tensor([-1.0])], [torch.tensor([-math.inf])])


def test_ulp_distance():
    a = torch.tensor(1.0, dtype=torch.float32)
    b = torch.nextafter(torch.nextafter(a, torch.tensor(2.0)), torch.tensor(2.0))
    assert ulp_distance(float(a), float(b)) == 2
    assert ulp_distance(-0.5, -0.5) == 0
    assert ulp_distance(float(np.nextafter(np.float32(-0.0), np.float32(1))), -0.0) == 1
