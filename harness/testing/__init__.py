"""Test-only code: planted faults and kernels, tiny generated models (tests and benchmarks)."""
