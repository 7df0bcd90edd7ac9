"""What a norm module computes, read from its own forward on small CPU probes (coverage's norm classes).

A norm is one of the variants the wrappers implement (`NORM_REFERENCES`: w * x_hat or (1 + w) * x_hat RMSNorm,
torch's LayerNorm, a LayerNorm written out in float32, LayerNorm with w + 1), with or without a weight of its own
(OLMo's LayerNorm and nanochat's RMSNorm have none: the wrappers then run the variant with a unit weight). Its
epsilon is read from the forward too (`read_norm_eps`): a module may hold it under any name, or hard-code it in its
forward, and a wrong epsilon only shows on rows whose mean square is near it, where both sides would then agree on
a value the model never computes.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tic.harness.kernels.autograd import layer_norm_float32_written_out

# where modules and configs keep a norm's epsilon
EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "norm_eps", "layer_norm_eps")
# the epsilons norms use where they hard-code one (tried after the module's own)
COMMON_EPS = (1e-5, 1e-6, 1e-8, 1e-12, 1e-3, 1e-4, 1e-7, 1e-10)
# probe rows scaled so that their mean square runs from about 2 down to 2e-12: an epsilon shows where it is near
EPS_PROBE_SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def is_rmsnorm(m) -> bool:
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)


def is_layernorm(m) -> bool:
    """torch's own LayerNorm over the last dimension (a subclass with a forward of its own is not assumed to be)."""
    return isinstance(m, nn.LayerNorm) and type(m).forward is nn.LayerNorm.forward and len(m.normalized_shape) == 1


def is_weightless_norm(m) -> bool:
    """A norm module of no parameters and no children (OLMo's LayerNorm, nanochat's RMSNorm): what it computes is
    read by norm_reading."""
    return isinstance(m, nn.Module) and "norm" in type(m).__name__.lower() and not isinstance(m, nn.LayerNorm) \
        and next(m.parameters(), None) is None and next(m.children(), None) is None


def is_norm(m) -> bool:
    return is_rmsnorm(m) or is_layernorm(m) or is_weightless_norm(m)


def norm_eps(m) -> float:
    """The epsilon the wrappers run a norm with: the one C0 read from its forward (`_tic_eps`, set at wrap time)
    where that differs from what the module holds, else the module's own."""
    read = getattr(m, "_tic_eps", None)
    return float(read) if read is not None else float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))


def _rms_hat(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# variant -> its value on float32 probe rows x with probe parameters p (weight, bias where the module has them)
NORM_REFERENCES = {
    "norm:rms": lambda x, p, eps: _rms_hat(x, eps) * p["weight"] if "weight" in p else _rms_hat(x, eps),
    "norm:rms_1p": lambda x, p, eps: _rms_hat(x, eps) * (1.0 + p["weight"]),
    "norm:layer": lambda x, p, eps: F.layer_norm(x, (x.shape[-1],), p.get("weight"), p.get("bias"), eps),
    "norm:layer_float32": lambda x, p, eps: layer_norm_float32_written_out(x, p.get("weight"), p.get("bias"), eps),
    "norm:layer_1p": lambda x, p, eps: F.layer_norm(x, (x.shape[-1],), p["weight"] + 1, p["bias"], eps),
}


def norm_width(m) -> int:
    """The width of the rows a norm takes: its weight's, else its normalized_shape's (OLMo's weightless LayerNorm
    takes no other), else any (16)."""
    w, shape = getattr(m, "weight", None), getattr(m, "normalized_shape", None)
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return int(w.shape[-1])
    if isinstance(shape, (tuple, list)) and shape and isinstance(shape[-1], int):
        return int(shape[-1])
    return 16


def probe_input(d: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, 2 * d, dtype=torch.float32).reshape(2, d)


def norm_on_probe(m, params: dict, x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, the norm's own output on x, as it returns it) on CPU probe rows x (default probe_input, norm_width wide)
    with `params` (CPU float32 tensors by name) in place of its parameters; None when it does not run there."""
    probe = copy.copy(m)  # shallow: the module's settings, CPU parameters of its own, the class's own forward
    probe._parameters = dict(probe._parameters)
    for name, t in params.items():
        probe._parameters[name] = nn.Parameter(t, requires_grad=False)
    if x is None:
        x = probe_input(norm_width(m))
    try:
        with torch.no_grad():
            y = type(m).forward(probe, x)
    except Exception:  # noqa: BLE001 - a norm that does not run on a probe is one the wrappers do not know
        return None
    return x, y


def probe_params(m, d: int) -> dict:
    """Fixed probe values for the norm's weight (0.25 + a ramp) and bias (a ramp around 0), where it has
    them."""
    params = {}
    if isinstance(getattr(m, "weight", None), torch.Tensor):
        params["weight"] = torch.linspace(0.25, 0.75, d, dtype=torch.float32)
    if isinstance(getattr(m, "bias", None), torch.Tensor):
        params["bias"] = torch.linspace(-0.1, 0.1, d, dtype=torch.float32)
    return params


def _computes(m, variant: str, params: dict, eps: float, x: torch.Tensor | None = None) -> bool:
    """Whether the norm's own forward gives NORM_REFERENCES[variant] with this epsilon (float32, within float32's
    reordering noise) on probe rows x."""
    ran = norm_on_probe(m, params, x)
    if ran is None:
        return False
    x, y = ran
    y = y[0] if isinstance(y, tuple) else y
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return False
    ref = NORM_REFERENCES[variant](x, params, eps)
    return torch.allclose(y.float(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max().clamp(min=1e-30)))


def norm_variant(m) -> str | None:
    """'norm:rms' or 'norm:rms_1p', from the module's own forward on a CPU probe (weight 0.25 + a ramp): which
    of w * x_hat and (1 + w) * x_hat it computes; None for neither."""
    params = {"weight": torch.linspace(0.25, 0.75, int(m.weight.shape[-1]), dtype=torch.float32)}
    return next((v for v in ("norm:rms", "norm:rms_1p") if _computes(m, v, params, norm_eps(m))), None)


def layer_norm_float32_variant(m) -> str | None:
    """'norm:layer_float32' when a norm that is not torch's LayerNorm computes LayerNorm written out in float32 on a
    CPU probe (a 1-D weight, an optional bias; autograd.layer_norm_float32_written_out), else None."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or (b is not None and not isinstance(b, torch.Tensor)):
        return None
    computes = _computes(m, "norm:layer_float32", probe_params(m, int(w.shape[-1])), norm_eps(m))
    return "norm:layer_float32" if computes else None


def layer_norm_1p_variant(m) -> str | None:
    """'norm:layer_1p' when a norm that is not torch's LayerNorm computes torch's LayerNorm with weight + 1 on a CPU
    probe (Nemotron's LayerNorm1P: a 1-D weight and bias), else None."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(b, torch.Tensor):
        return None
    d = int(w.shape[-1])
    params = {"weight": torch.linspace(-0.25, 0.25, d, dtype=torch.float32),
              "bias": torch.linspace(-0.1, 0.1, d, dtype=torch.float32)}
    return "norm:layer_1p" if _computes(m, "norm:layer_1p", params, norm_eps(m)) else None


def norm_reading(m) -> tuple[str | None, float | None]:
    """(the variant a norm module computes (NORM_REFERENCES), the epsilon its forward computes it with): the variant
    None for a norm the wrappers do not implement; the epsilon None where read_norm_eps finds none. A norm without
    parameters is RMSNorm or torch's LayerNorm with a unit weight (and no bias), whichever gives its forward at an
    epsilon read_norm_eps finds."""
    if is_layernorm(m):
        return "norm:layer", norm_eps(m)  # torch's own: its eps is what it computes with
    if is_weightless_norm(m):
        for variant in ("norm:rms", "norm:layer"):
            eps = read_norm_eps(m, variant)
            if eps is not None:
                return variant, eps
        return None, None
    variant = norm_variant(m) if is_rmsnorm(m) else layer_norm_float32_variant(m) or layer_norm_1p_variant(m)
    return variant, None if variant is None else read_norm_eps(m, variant)


def read_norm_eps(m, variant: str) -> float | None:
    """The epsilon at which the norm's own forward gives `variant` on probe rows of every scale in
    EPS_PROBE_SCALES: the module's own (norm_eps) where that one does, else the first of its other epsilon
    attributes and COMMON_EPS that does; None where none does."""
    d = norm_width(m)
    params = probe_params(m, d)
    if variant == "norm:layer_1p":
        params["weight"] = params["weight"] - 0.5  # a weight around 0, as LayerNorm1P keeps it
    rows = [probe_input(d) * s for s in EPS_PROBE_SCALES]
    candidates = [norm_eps(m), *(getattr(m, a) for a in EPS_ATTRIBUTES if isinstance(getattr(m, a, None), float)),
                  *COMMON_EPS]
    for eps in dict.fromkeys(float(e) for e in candidates):
        if all(_computes(m, variant, params, eps, x) for x in rows):
            return eps
    return None
