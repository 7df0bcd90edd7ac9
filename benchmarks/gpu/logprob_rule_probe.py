"""Does the training side's V2 logprob rule give what vLLM's V2 runner returns, bit for bit? vLLM's V2 runner
computes the logprobs it returns with a Triton kernel of its own (vllm.v1.worker.gpu.sample.logprob); tic's vLLM
provider asks that kernel for each row's log-sum-exp and builds every token's logprob from it
(tic.harness.kernels.vllm_provider.v2_sampler_log_softmax).

  python benchmarks/gpu/logprob_rule_probe.py

For each row count, vocabulary and logits dtype: the kernel's logprobs of random tokens against the provider's
V2 rule and against torch's float32 log_softmax (the V1 runner's), as the fraction of tokens bitwise equal.
Exits 1 when the V2 rule is not bitwise the kernel on every token.
"""

from __future__ import annotations

import sys

SHAPES = [(33, 32000), (256, 151936), (2048, 151936), (512, 128256), (300, 262144)]


def main() -> int:
    import torch
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    from tic.harness.kernels.vllm_provider import v2_sampler_log_softmax

    print("| rows | vocab | logits | V2 rule = kernel | V2 rule on float32 logits = kernel | "
          "torch log_softmax = kernel |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for rows, vocab in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device="cuda").manual_seed(rows + vocab)
            logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(dtype)
            ids = torch.randint(0, vocab, (rows, 4), device="cuda", generator=g)
            ids[:, 0] = logits.argmax(dim=-1)  # the top token too
            want = compute_token_logprobs(logits, ids)
            rule = v2_sampler_log_softmax(logits).gather(-1, ids)
            widened = v2_sampler_log_softmax(logits.float()).gather(-1, ids)  # the kernel's float32 variant
            torch_lp = logits.log_softmax(dim=-1, dtype=torch.float32).gather(-1, ids)
            same = (rule == want).float().mean().item()
            bad += same != 1.0
            print(f"| {rows} | {vocab} | {str(dtype).split('.')[-1]} | {same:.4f} | "
                  f"{(widened == want).float().mean().item():.4f} | "
                  f"{(torch_lp == want).float().mean().item():.4f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
