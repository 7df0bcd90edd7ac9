"""The tic.yaml settings a small generated model climbs C0-C7 with on CPU in a few seconds (after its `model:`
line): three random prompts, six sampled tokens, one layout probe, no locator."""

SMALL_LADDER = ("rollout: {engine: hf, kernels: consistent, batch_size: 3}\n"
                "train: {engine: hf, kernels: consistent, micro_batch_size: 2}\n"
                "prompts: {source: random, count: 3, seed: 0, min_len: 4, max_len: 12}\n"
                "sampling: {temperature: 1.0, max_tokens: 6, seed: 0}\n"
                "layouts: {batch_sizes: [3], positions: [first, last], probes: 1}\n"
                "locate: {enabled: false}\n")
