"""Does a checkpoint load and generate in vLLM? Checked in a child process (vLLM owns the GPU and its own
process state), only where vLLM is importable and a GPU is present."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

_MARK = "TIC_VLLM_GENERATED"
_SCRIPT = f"""
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256, seed=0,
          skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28)
out = llm.generate([{{"prompt_token_ids": [1, 5, 7, 9, 11, 13]}}], SamplingParams(max_tokens=4, temperature=0.0))
ids = list(out[0].outputs[0].token_ids)
print("{_MARK}", len(ids), flush=True)
"""


def vllm_available() -> bool:
    """vLLM importable and a CUDA device visible."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def vllm_generates(model_dir: Path, timeout_s: int = 900) -> str | None:
    """None when vLLM loads model_dir and generates at least one token; else the reason in one line."""
    try:
        r = subprocess.run([sys.executable, "-c", _SCRIPT, str(Path(model_dir).resolve())], capture_output=True,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"vLLM did not finish loading and generating within {timeout_s} s"
    for line in r.stdout.splitlines():
        if line.startswith(_MARK) and int(line.split()[1]) > 0:
            return None
    lines = [x.strip() for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()]
    # the exception line, not the shutdown warnings printed after it
    errors = [x for x in lines if re.search(r"[A-Za-z]*(Error|Exception)\b", x) and "Warning" not in x]
    why = (errors or lines or ["no output"])[-1]
    return f"vLLM exited {r.returncode}: {why[:300]}"
