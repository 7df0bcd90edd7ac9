"""Layer shapes of public models, as their config.json gives them, for 4-layer cuts with random weights.

Each entry keeps what sets the kernels' problem shapes and arithmetic: hidden size, heads, KV heads, head_dim,
MLP or expert widths, expert count and top-k, vocabulary, rotary parameters, biases, tied embeddings, norm eps.
Only the depth changes (num_hidden_layers), so every GEMM, norm, rotary and attention call of a cut has the shape
it has in the full model. The figures are the models' published config.json values.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    name: str                 # the public model these layer shapes come from
    model_type: str
    architecture: str
    hidden: int
    intermediate: int         # dense MLP width (MoE models: their config's intermediate_size, unused by MoE layers)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rms_norm_eps: float
    rope: dict                # rope_theta and any rope_scaling, as config.json spells them
    tie_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # family fields: experts, top-k, MoE width, biases
    layers: int = 0           # the full model's depth (num_hidden_layers), for full-depth runs

    @property
    def experts(self) -> int:
        return int(self.extra.get("num_experts") or self.extra.get("num_local_experts") or 0)

    @property
    def top_k(self) -> int:
        return int(self.extra.get("num_experts_per_tok") or 0)

    @property
    def slug(self) -> str:
        return self.name.lower().replace(".", "p").replace("_", "-")

    def config(self, layers: int = 4, dtype: str = "bfloat16") -> dict:
        """config.json of a `layers`-layer cut: the model's own fields, depth changed."""
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": layers, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": 0.02, "dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
            **self.rope, **self.extra,
        }

    def params(self, layers: int = 4) -> int:
        """Parameter count of the cut (for sizing how many runs share the GPU)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        if self.experts:
            width = int(self.extra.get("moe_intermediate_size") or self.intermediate)
            mlp = self.experts * 3 * self.hidden * width + self.hidden * self.experts
        else:
            mlp = 3 * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return layers * (attn + mlp) + emb


QWEN3_ROPE = {"rope_theta": 1000000.0}

SHAPES: tuple[Shape, ...] = (
    Shape("Qwen3-1.7B", "qwen3", "Qwen3ForCausalLM", 2048, 6144, 16, 8, 128, 151936, 40960, 1e-6, QWEN3_ROPE,
          tie_embeddings=True, extra={"attention_bias": False}, layers=28),
    Shape("Qwen3-4B", "qwen3", "Qwen3ForCausalLM", 2560, 9728, 32, 8, 128, 151936, 40960, 1e-6, QWEN3_ROPE,
          tie_embeddings=True, extra={"attention_bias": False}, layers=36),
    Shape("Qwen3-8B", "qwen3", "Qwen3ForCausalLM", 4096, 12288, 32, 8, 128, 151936, 40960, 1e-6, QWEN3_ROPE,
          extra={"attention_bias": False}, layers=36),
    Shape("Qwen3-14B", "qwen3", "Qwen3ForCausalLM", 5120, 17408, 40, 8, 128, 151936, 40960, 1e-6, QWEN3_ROPE,
          extra={"attention_bias": False}, layers=40),
    Shape("Qwen3-32B", "qwen3", "Qwen3ForCausalLM", 5120, 25600, 64, 8, 128, 151936, 40960, 1e-6, QWEN3_ROPE,
          extra={"attention_bias": False}, layers=64),
    Shape("Qwen2.5-7B", "qwen2", "Qwen2ForCausalLM", 3584, 18944, 28, 4, 128, 152064, 131072, 1e-6,
          {"rope_theta": 1000000.0}, extra={"use_sliding_window": False, "sliding_window": None}, layers=28),
    Shape("Llama-3.1-8B", "llama", "LlamaForCausalLM", 4096, 14336, 32, 8, 128, 128256, 131072, 1e-5,
          {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}},
          extra={"attention_bias": False, "mlp_bias": False}, layers=32),
    Shape("Mistral-7B-v0.3", "mistral", "MistralForCausalLM", 4096, 14336, 32, 8, 128, 32768, 32768, 1e-5,
          {"rope_theta": 1000000.0}, extra={"sliding_window": None}, layers=32),
    Shape("Mistral-Nemo-12B", "mistral", "MistralForCausalLM", 5120, 14336, 32, 8, 128, 131072, 1024000, 1e-5,
          {"rope_theta": 1000000.0}, extra={"sliding_window": None}, layers=40),
    Shape("Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeForCausalLM", 2048, 6144, 32, 4, 128, 151936, 40960, 1e-6,
          QWEN3_ROPE, extra={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                             "attention_bias": False}, layers=48),
    Shape("Mixtral-8x7B", "mixtral", "MixtralForCausalLM", 4096, 14336, 32, 8, 128, 32000, 32768, 1e-5,
          {"rope_theta": 1000000.0}, extra={"num_local_experts": 8, "num_experts_per_tok": 2,
                                            "sliding_window": None}, layers=32),
    Shape("OLMoE-1B-7B", "olmoe", "OlmoeForCausalLM", 2048, 1024, 16, 16, 128, 50304, 4096, 1e-5,
          {"rope_theta": 10000.0}, extra={"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
                                          "clip_qkv": None, "attention_bias": False}, layers=16),
)


@dataclass(frozen=True)
class HybridShape(Shape):
    """A Mamba-2 / attention / MLP hybrid in NemotronH's layout: `pattern` has one character per layer, M a
    Mamba-2 mixer, * attention, - a relu2 MLP; extra holds the mixer's fields (mamba_num_heads, mamba_head_dim,
    ssm_state_size, n_groups, chunk_size, conv_kernel, expand). Only full-depth runs use it (the 4-layer hybrid
    cuts are the t-nemotron-h configs)."""
    pattern: str = ""

    @property
    def mixers(self) -> int:
        return self.pattern.count("M")

    def config(self, layers: int = 0, dtype: str = "bfloat16") -> dict:
        """config.json at the model's full depth (its pattern sets the layers)."""
        return {
            "architectures": [self.architecture], "model_type": self.model_type, "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": len(self.pattern),
            "hybrid_override_pattern": self.pattern, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "mlp_hidden_act": "relu2",
            "mamba_hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_bias": False,
            "use_conv_bias": True, "layer_norm_epsilon": self.rms_norm_eps, "residual_in_fp32": False,
            "max_position_embeddings": self.max_positions, "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": 0.02, "dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, **self.extra,
        }

    def params(self, layers: int = 0) -> int:
        """Parameter count at full depth (layers 0: the embeddings alone, as Shape.params(0))."""
        e = self.extra
        heads, hd, groups, state = e["mamba_num_heads"], e["mamba_head_dim"], e["n_groups"], e["ssm_state_size"]
        inner = heads * hd
        mixer = self.hidden * (2 * inner + 2 * groups * state + heads) + inner * self.hidden
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per = {"M": mixer, "*": self.hidden * (q + 2 * kv) + q * self.hidden, "-": 2 * self.hidden * self.intermediate}
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return (sum(per[c] for c in self.pattern) if layers else 0) + emb


HYBRID_SHAPES = (
    HybridShape("Nemotron-H-8B", "nemotron_h", "NemotronHForCausalLM", 4096, 21504, 32, 8, 128, 131072, 8192, 1e-5,
                {}, extra={"mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                           "chunk_size": 128, "conv_kernel": 4, "expand": 2},
                layers=52, pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
)


def by_name(names: list[str] | None = None) -> list[Shape]:
    """The named shapes (hybrids by name only); none named: every transformer shape."""
    if not names:
        return list(SHAPES)
    known = {s.name: s for s in (*SHAPES, *HYBRID_SHAPES)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown shape {unknown[0]!r}; known: {', '.join(known)}")
    return [known[n] for n in names]
