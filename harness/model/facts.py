"""The model under test as engines see it: the directory holding its weights, the dtype tic.yaml asks for, and
its config.json. The gate context builds it once per run; engines and checks take it as a parameter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tic.core.errors import TicInputError


def vocab_size(config: dict[str, Any]) -> int:
    """config.json's vocabulary size (a multimodal config's text model's)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    v = config.get("vocab_size") or text.get("vocab_size")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise TicInputError("model config.json has no vocab_size")
    return v


@dataclass(frozen=True, eq=False)
class ModelFacts:
    dir: Path  # holds config.json and the weights (generated ones: their cache directory)
    dtype: str  # model.dtype of tic.yaml: float32 | bfloat16 | float16 | auto
    config: dict[str, Any]  # config.json, parsed and checked

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.config)

    @property
    def max_positions(self) -> int:
        text = self.config.get("text_config", self.config)
        return int(text.get("max_position_embeddings", 2048))
