"""tic: train-inference consistency. Rollout and training must give bitwise-identical logprobs."""

__version__ = "0.1.0"
