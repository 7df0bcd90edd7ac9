"""Bundled patches for Megatron-core, one module each (each defines PATCH). tic's megatron train engine applies
the names in `train: {patches: [...]}` in its own process (Megatron has no plugin entry point); a Megatron trainer
of one's own calls `tic.patches.apply([...])` after importing megatron.core."""
