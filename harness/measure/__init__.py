"""Measurement: metrics, the RL loop, throughput, the baseline, the gradient check, batch layouts, prompts,
fingerprints, parallel layouts."""
