"""A stand-in for a paged varlen attention kernel (FlashAttention's calling convention as vLLM uses it) and a
vLLM-style Python wrapper op over it, for CPU tests of operator recording and repro reduction.

`tic_pageddemo::fwd` splits the keys of a one-query sequence in two halves and merges the partial softmaxes
(as split-KV decode kernels do) unless num_splits == 1, so decode and prefill layouts give different bits for
the same row, exactly the kind of difference seen in vLLM's attention. Importing this module registers the ops
(a fresh repro process imports it by the namespace's name)."""

import torch
from torch.library import Library

MODE = {"thirds": False}
_lib = Library("tic_pageddemo", "DEF")
_lib.define("fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor cu_seqlens_q, Tensor seqused_k, "
            "int max_seqlen_q, int max_seqlen_k, Tensor page_table, Tensor? scheduler_metadata, int num_splits) "
            "-> Tensor[]")


def _fwd(q, k, v, out, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, scheduler_metadata,
         num_splits):
    cuts = cu_seqlens_q.tolist()
    block = k.shape[1]
    for s in range(len(cuts) - 1):
        a, b, n = cuts[s], cuts[s + 1], int(seqused_k[s])
        pages = page_table[s, :-(-n // block)].long()
        ks = k.index_select(0, pages).reshape(-1, *k.shape[2:])[:n].float()  # [n, heads, dim]
        vs = v.index_select(0, pages).reshape(-1, *v.shape[2:])[:n].float()
        for i in range(a, b):
            p = n - (b - i)  # the query row's position: the last rows of the sequence
            qi = q[i].float()  # [heads, dim]
            scores = torch.einsum("hd,nhd->hn", qi, ks[:p + 1]) * qi.shape[-1] ** -0.5
            if b - a == 1 and num_splits != 1 and p >= 2:  # split-KV: two partial softmaxes merged
                h = (p + 1) // (3 if MODE["thirds"] else 2)  # a process-wide setting, like a kernel mode
                parts = []
                for lo, hi in ((0, h), (h, p + 1)):
                    m = scores[:, lo:hi].amax(-1, keepdim=True)
                    e = torch.exp(scores[:, lo:hi] - m)
                    parts.append((m, e.sum(-1, keepdim=True), torch.einsum("hn,nhd->hd", e, vs[lo:hi])))
                m = torch.maximum(parts[0][0], parts[1][0])
                num = sum(torch.exp(pm - m) * acc for pm, _, acc in parts)
                den = sum(torch.exp(pm - m) * l for pm, l, _ in parts)
                o = num / den
            else:
                w = torch.softmax(scores, -1)
                o = torch.einsum("hn,nhd->hd", w, vs[:p + 1])
            out[i] = o.to(out.dtype)
    return [out]


_lib.impl("fwd", _fwd, "CPU")

# The same kernel called as FlashAttention 3's `fwd` is by a caller that passes no output buffer (tic's training
# provider): it allocates and returns its output.
_lib.define("fwd_new(Tensor q, Tensor k, Tensor v, Tensor(a!)? out, Tensor cu_seqlens_q, Tensor seqused_k, "
            "int max_seqlen_q, int max_seqlen_k, Tensor page_table, Tensor? scheduler_metadata, int num_splits) "
            "-> Tensor[]")


def _fwd_new(q, k, v, out, *rest):
    return _fwd(q, k, v, torch.empty_like(q) if out is None else out, *rest)


_lib.impl("fwd_new", _fwd_new, "CPU")

# A wrapper in the style of vLLM's unified_attention_with_output: it takes a layer name and reads the step's
# metadata from a context that exists only during a forward, so it cannot be called on its own.
_wrap = Library("tic_wrapdemo", "DEF")
_wrap.define("attention(Tensor q, Tensor(a!) out, str layer_name) -> ()")
STEP: dict = {}


def _attention(q, out, layer_name):
    m = STEP[layer_name]
    n = int(m["cu_seqlens_q"][-1])  # like vLLM: the kernel writes the step's rows of a larger buffer
    torch.ops.tic_pageddemo.fwd(q[:n], m["k"], m["v"], out[:n], m["cu_seqlens_q"], m["seqused_k"], m["max_seqlen_q"],
                                m["max_seqlen_k"], m["page_table"], None, 0)


_wrap.impl("attention", _attention, "CPU")

# An in-place add + RMS norm whose reduction order depends on the number of rows (as vLLM's fused_add_rms_norm
# picks another kernel variant for large batches): writes residual <- x + residual and x <- norm(residual).
_lib.define("add_norm(Tensor(a!) x, Tensor(b!) residual, float eps) -> ()")


def _add_norm(x, residual, eps):
    residual.add_(x)
    sq = residual.float() ** 2
    if residual.shape[0] > 4:  # "the large-batch variant": the sum in two halves
        h = sq.shape[-1] // 2
        var = (sq[:, :h].sum(-1, keepdim=True) + sq[:, h:].sum(-1, keepdim=True)) / sq.shape[-1]
    else:
        var = sq.sum(-1, keepdim=True) / sq.shape[-1]
    x.copy_((residual.float() * torch.rsqrt(var + eps)).to(x.dtype))


_lib.impl("add_norm", _add_norm, "CPU")
