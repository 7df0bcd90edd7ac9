"""Compile options tic's Triton kernels pin instead of taking the installed Triton's defaults.

A default can move between Triton releases: Triton 3.9 warns that 3.10 stops contracting a multiply and an add into
one FMA unless asked, which changes a kernel's rounding. A rollout and a trainer in two environments (a vLLM image
and a Megatron image) must compile the same arithmetic, and every GPU figure of these kernels was measured with
FMA contraction on, Triton's default up to 3.9.
"""

PINNED = {"enable_fp_fusion": True}
