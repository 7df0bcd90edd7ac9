"""Three requests through vLLM-style steps of a recurrent mixer stand-in (the Mamba patches' CPU tests)."""

from __future__ import annotations

import torch


def serve(step, mixer, a, b, c):
    """step(mixer, decodes [(line, row)], prefills [(line, computed, rows)]) -> the step's output rows, decodes
    first. Request a (line 1): prompt 11, prefilled 5 + 6 (the second piece beside b's and c's first decodes);
    request b (line 2): prompt 6; request c (line 3): a prompt of 2, shorter than a Mamba-2 test chunk, so that a
    decode step ends its first chunk; then all decode. Returns each request's output rows per token. (Line 0 is
    vLLM's null block: padding, which the kernels skip.)"""
    outs = {1: [], 2: [], 3: []}
    o = step(mixer, [], [(1, 0, a[:5]), (2, 0, b[:6]), (3, 0, c[:2])])
    outs[1].append(o[:5]), outs[2].append(o[5:11]), outs[3].append(o[11:])
    o = step(mixer, [(2, b[6]), (3, c[2])], [(1, 5, a[5:11])])
    outs[2].append(o[:1]), outs[3].append(o[1:2]), outs[1].append(o[2:])
    seqs, pos = {1: a, 2: b, 3: c}, {1: 11, 2: 7, 3: 3}
    while any(pos[s] < t.shape[0] for s, t in seqs.items()):
        live = [s for s, t in seqs.items() if pos[s] < t.shape[0]]
        o = step(mixer, [(s, seqs[s][pos[s]]) for s in live], [])
        for r, s in enumerate(live):
            outs[s].append(o[r:r + 1])
            pos[s] += 1
    return tuple(torch.cat(outs[s]) for s in (1, 2, 3))
