"""Bundled patches for vLLM, one module each (each defines PATCH)."""
