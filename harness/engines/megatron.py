"""Megatron-core train engine: a GPTModel built from the model's config.json, its weights converted from the HF
checkpoint (tic.harness.model.megatron_convert), every layer's operator run through tic's kernel wrappers by the
layer specs of tic.harness.engines.megatron_spec.

Scoring, micro-batches, padding, packing, sequence order and policy gradients are the hf engine's
(tic.harness.engines.hf.HFEngine): the Megatron model is presented behind the call the hf engine makes
(`model(input_ids=, attention_mask=, position_ids=).logits`), so the two train sides differ in the model alone.
One process, tensor / pipeline / expert / context parallel 1 (parallel_state is initialised with those sizes so a
later release can raise them); `megatron-core` is imported when an engine is built.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from tic.config.schema import BackwardConfig
from tic.core.errors import TicInputError
from tic.harness.engines.hf import WRAPPED_KERNELS, HFEngine, cached_model
from tic.harness.engines.megatron_spec import ForwardBatch, TicShared, gpt_block_spec
from tic.harness.kernels.autograd import Backward, Ops
from tic.harness.kernels.modules import ResidualStream, RopeTable, RouteLog
from tic.harness.kernels.providers import provider_for
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.kernels.vllm_provider import require_vllm
from tic.harness.model.megatron_convert import (AttentionShape, check_family, conversion_plan, hf_to_megatron,
                                                megatron_to_hf, fused_expert_layout, module_map, num_experts)


def require_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise TicInputError("train.engine megatron needs megatron-core: pip install 'tic-consistency[megatron]'") \
            from None


def refusals(side_cfg, model_cfg: dict | None = None) -> list[str]:
    """Why this engine cannot run a train side as configured (C0 lists them; build refuses the first)."""
    out, par = [], side_cfg.parallel
    others = {k: getattr(par, k) for k in ("tp", "dp", "ep", "cp", "dcp") if getattr(par, k) > 1}
    if others:
        out.append("train.engine megatron runs one process with tensor, data, expert and context parallel 1 "
                   f"(got {', '.join(f'{k}={v}' for k, v in others.items())})")
    if side_cfg.kernels not in WRAPPED_KERNELS:
        out.append(f"train.engine megatron runs tic's kernel wrappers: kernels consistent or vllm, not "
                   f"{side_cfg.kernels!r}")
    if model_cfg is not None:
        try:
            check_family(model_cfg)
        except TicInputError as e:
            out.append(str(e))
    return out


def init_parallel_state(device: str) -> None:
    """torch.distributed with one rank (gloo on CPU, nccl on a GPU) and Megatron's model-parallel groups of one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device != "cpu" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                 context_parallel_size=1, expert_model_parallel_size=1)


def transformer_config(cfg: dict, dtype: torch.dtype):
    """Megatron's TransformerConfig for an HF config.json (Qwen3, Qwen3-MoE, Llama)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = AttentionShape.of(cfg)
    moe = {}
    if num_experts(cfg):
        moe = dict(num_moe_experts=num_experts(cfg), moe_router_topk=int(cfg["num_experts_per_tok"]),
                   moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]))
    return TransformerConfig(
        num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
        num_attention_heads=shape.heads, num_query_groups=shape.groups, kv_channels=shape.head_dim,
        ffn_hidden_size=int(cfg["intermediate_size"]), layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=bool(cfg.get("attention_bias")),
        qk_layernorm=cfg["model_type"] in ("qwen3", "qwen3_moe"), params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        deterministic_mode=True, **moe)


def _hf_rotary(hf_config) -> nn.Module:
    """The family's HF rotary module (its inv_freq and rope scaling): the cos|sin table both sides index."""
    kind = hf_config.model_type
    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
    return cls(config=hf_config)


def block_causal_mask(padding: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T], True = attend: causal, within one sequence (a packed row restarts its position ids at
    0), and only to keys the padding mask keeps."""
    B, T = positions.shape
    idx = torch.arange(T, device=positions.device)
    causal = idx[None, :] <= idx[:, None]
    seq = (positions == 0).cumsum(-1)
    keep = causal[None] & (seq[:, :, None] == seq[:, None, :])
    if padding is not None:
        keep = keep & padding.bool()[:, None, :]
    return keep[:, None]


class MegatronCausalLM(nn.Module):
    """A GPTModel (tic layer specs) behind the HF causal-LM call the hf engine makes. `gpt` holds the weights
    under Megatron's names; `hf_weights()` gives them under the checkpoint's."""

    def __init__(self, hf_config, cfg: dict, provider, backward: BackwardConfig | None, dtype: torch.dtype):
        super().__init__()
        from megatron.core.models.gpt import GPTModel

        ops = Ops(provider, Backward(backward))
        self.config, self.model_cfg, self._tic_ops, self._tic_routes = hf_config, cfg, ops, RouteLog()
        self.batch, self.checkpoint_names = ForwardBatch(), ()
        shared = TicShared(ops, ResidualStream(), RopeTable(_hf_rotary(hf_config), dtype, provider, hf_config),
                           self.batch, self._tic_routes, bool(provider.fuse_projections))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        moe_layers = [num_experts(cfg) > 0 and i not in mlp_only and (i + 1) % step == 0
                      for i in range(int(cfg["num_hidden_layers"]))]
        spec = gpt_block_spec(shared, moe_layers, bool(cfg.get("attention_bias")),
                              bool(cfg.get("norm_topk_prob", True)))
        self.gpt = GPTModel(transformer_config(cfg, dtype), spec, vocab_size=int(cfg["vocab_size"]),
                            max_sequence_length=int(cfg.get("max_position_embeddings") or 4096),
                            position_embedding_type="none",
                            share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")))
        for name, m in self.gpt.named_modules():
            if hasattr(m, "top_k") and hasattr(m, "router"):  # routes under the HF block's name (C7 pins them)
                m.name = f"model.layers.{name.split('.')[2]}.mlp"

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **_):
        B, T = input_ids.shape
        pos = position_ids if position_ids is not None else \
            torch.arange(T, device=input_ids.device)[None].expand(B, T)
        self.batch.positions, self.batch.mask = pos, block_causal_mask(attention_mask, pos)
        try:
            h = self.gpt.embedding(input_ids=input_ids, position_ids=pos)
            h = self.gpt.decoder(hidden_states=h, attention_mask=None)
        finally:
            self.batch.positions = self.batch.mask = None
        w = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights \
            else self.gpt.output_layer.weight
        return SimpleNamespace(logits=self._tic_ops.linear(h.transpose(0, 1).contiguous(), [w], [None]))

    def load_hf(self, hf: dict[str, torch.Tensor]) -> None:
        self.checkpoint_names = tuple(hf)  # the conversion's plan (conversion_plan) is read from them again
        missing, unexpected = self.gpt.load_state_dict(hf_to_megatron(hf, self.model_cfg), strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise TicInputError(f"megatron model: converted weights do not fit (missing {missing[:2]}, "
                                f"unexpected {unexpected[:2]})")

    def hf_named_modules(self) -> dict[str, nn.Module]:
        """The GPTModel's modules under the checkpoint's module names where the converter's name map gives one
        (module_map: model.layers.N.self_attn for decoder.layers.N.self_attention), else under their own
        (decoder.layers.N.self_attn_bda)."""
        own = {n: m for n, m in self.gpt.named_modules() if n}
        hf_of = {mg: hf for hf, mg in module_map(conversion_plan(self.checkpoint_names, self.model_cfg)).items()}
        return {hf_of.get(n, n): m for n, m in own.items()}

    def sequence_first_modules(self) -> set[int]:
        """ids of the modules whose hidden states are sequence-first [T, B, H]: Megatron's transformer layers and
        every module its block or a layer calls with them (their children); tic's modules inside those and the
        word embedding work on [B, T, ...]."""
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_layer import TransformerLayer

        out = set()
        for m in self.gpt.modules():
            if isinstance(m, TransformerLayer):
                out.add(id(m))
            if isinstance(m, (TransformerLayer, TransformerBlock)):
                out |= {id(c) for c in m.children()}
        return out

    @torch.no_grad()
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's names and layout (q/k/v and gate/up apart, one tensor per expert):
        what a weight sync hands the rollout."""
        state = self.gpt.state_dict()
        return megatron_to_hf({k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)},
                              self.model_cfg)


def load_megatron_model(model_dir: Path, dtype: str, kernels: str, device: str, rollout: RolloutKernels,
                        backward: BackwardConfig | None, trainable: bool = False,
                        shared: bool = True) -> MegatronCausalLM:
    """The Megatron model of model_dir's config.json with the checkpoint's weights, on `device`, cached per
    configuration in the hf engine's model cache: the layouts C6 compares share one model, and the trainable copy
    (trainable=True) is one per configuration too. shared=False loads one of its own (C8/C9 update it)."""
    key = ("megatron", str(model_dir), dtype, kernels, device, rollout, backward, trainable)
    return cached_model(key, lambda: _load_megatron_model(model_dir, dtype, kernels, device, rollout,
                                                          backward, trainable), shared)


def _load_megatron_model(model_dir: Path, dtype: str, kernels: str, device: str, rollout: RolloutKernels,
                         backward: BackwardConfig | None, trainable: bool) -> MegatronCausalLM:
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    require_megatron()
    if kernels == "vllm":
        require_vllm(device)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    check_family(cfg)
    hf_config = AutoConfig.from_pretrained(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    hf = {k: v for f in files for k, v in load_file(str(f)).items()}
    torch_dtype = next(iter(hf.values())).dtype if dtype == "auto" else getattr(torch, dtype)
    init_parallel_state(device)
    model = MegatronCausalLM(hf_config, cfg, provider_for(kernels, rollout), backward, torch_dtype)
    model.load_hf({k: v.to(torch_dtype) for k, v in hf.items()})
    model.to(device).eval().requires_grad_(trainable)
    return model


class MegatronEngine(HFEngine):
    name = "megatron"

    def __init__(self, model_dir: Path, dtype: str = "auto", kernels: str = "consistent",
                 micro_batch_size: int = 4, padding_side: str = "right", packing: bool = False,
                 device: str = "cpu", order: str = "given", rollout: RolloutKernels = RolloutKernels(),
                 backward: BackwardConfig | None = None, shared_model: bool = True):
        self.model_dir, self.kernels, self.dtype, self.attn = Path(model_dir), kernels, dtype, "tic wrapped"
        self.device = torch.device(device)
        self._load_args = (self.model_dir, dtype, kernels, device, rollout, backward)
        self.model = load_megatron_model(*self._load_args, shared=shared_model)
        self.micro_batch_size = micro_batch_size
        self.padding_side, self.packing, self.order = padding_side, packing, order
        self.vocab_size = self.model.config.get_text_config().vocab_size

    @classmethod
    def from_config(cls, side_cfg, model_dir: Path, dtype: str, shared_model: bool = True,
                    rollout: RolloutKernels = RolloutKernels()) -> "MegatronEngine":
        why = refusals(side_cfg)
        if why:
            raise TicInputError(why[0])
        return cls(model_dir, dtype, side_cfg.kernels, side_cfg.micro_batch_size, side_cfg.padding_side,
                   side_cfg.packing, side_cfg.device, side_cfg.order, rollout, side_cfg.backward,
                   shared_model)

    def fingerprint(self) -> dict:
        import megatron.core

        return {"engine": self.name, "kernels": self.kernels, "dtype": self.dtype, "device": str(self.device),
                "megatron_core": getattr(megatron.core, "__version__", "?")}

    def generate(self, prompts, sampling, request_ids):
        raise TicInputError("megatron is a train engine; use rollout.engine: hf or vllm")

    generate_together = generate

    def trainable_model(self) -> MegatronCausalLM:
        return load_megatron_model(*self._load_args, trainable=True)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Under the checkpoint's names (what the rollout and the HF reference call them)."""
        return self.model.hf_weights()

    def policy_gradients(self, samples, sampling, advantages) -> dict[str, torch.Tensor]:
        """The hf engine's policy gradients through the Megatron model, under the names and layout of the HF
        model's parameters (the conversion moves gradients as it moves weights; experts fused as transformers
        holds them), which C7's reference has."""
        grads = super().policy_gradients(samples, sampling, advantages)
        return fused_expert_layout(megatron_to_hf({k.removeprefix("gpt."): v for k, v in grads.items()},
                                                  self.model.model_cfg))
