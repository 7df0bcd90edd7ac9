"""HF transformers engine: the embedded default, on CPU.

Rollout: batched sampling with a KV cache (left padding), each sampled token's logprob taken from the very
logits it was sampled from. Scoring/training: teacher-forced whole-sequence forward with micro-batch size,
padding side, packing and sequence order as options. `kernels: consistent` (tic's row-invariant CPU kernels) and
`kernels: vllm` (the installed vLLM's kernels, GPU) run every operator through tic's autograd wrappers, so the
same forward also trains (policy_gradients).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tic.config.schema import BackwardConfig
from tic.harness.engines.base import Engine, Sample, Sampling, request_seed
from tic.harness.engines.batches import micro_batches
from tic.harness.kernels.fp8 import attach_checkpoint, unquantized_config
from tic.harness.kernels.modules import apply, capture_routes
from tic.harness.kernels.providers import provider_for
from tic.harness.kernels.spec import RolloutKernels
from tic.harness.kernels.vllm_provider import require_vllm
from tic.harness.model.layer_structure import quiet_transformers
from tic.core.errors import TicInputError

_MODELS: dict[tuple, torch.nn.Module] = {}


def cached_model(key: tuple, load, shared: bool = True) -> torch.nn.Module:
    """The hf and megatron engines' model cache: load() once per key while shared; shared=False, an object of
    its own."""
    if not shared:
        return load()
    if key not in _MODELS:
        _MODELS[key] = load()
    return _MODELS[key]


WRAPPED_KERNELS = ("consistent", "vllm")  # kernels that run through tic's autograd wrappers


def load_model(model_dir: Path, dtype: str = "auto", kernels: str = "stock", attn: str = "sdpa", device: str = "cpu",
               rollout: RolloutKernels = RolloutKernels(), backward: BackwardConfig | None = None,
               trainable: bool = False, shared: bool = True, kv_cache_dtype: str = "auto"):
    """The model, cached per configuration. trainable=True gives a separate copy whose parameters take
    gradients (C7), so the inference copy the gates share is never touched. shared=False loads an object
    of its own, outside the cache (C8/C9 change its weights; the other gates' models must not see that).
    rollout, kv_cache_dtype: kernels vllm, what of the vLLM rollout its provider matches (its page size and logprob
    rule, tic.harness.kernels.spec.RolloutKernels) and its KV cache dtype; backward: how the wrappers' surrogate
    backward runs (tic.yaml train.backward)."""
    backward = backward if backward is not None else BackwardConfig()
    key = (str(model_dir), dtype, kernels, attn, device, rollout, kv_cache_dtype, backward, trainable)
    return cached_model(key, lambda: _load_model(model_dir, dtype, kernels, attn, device, rollout, backward,
                                                 trainable, kv_cache_dtype), shared)


def _load_model(model_dir: Path, dtype: str, kernels: str, attn: str, device: str, rollout: RolloutKernels,
                backward: BackwardConfig, trainable: bool, kv_cache_dtype: str):
    from transformers import AutoModelForCausalLM

    if kernels == "consistent" and device != "cpu":
        raise TicInputError("kernels: consistent are CPU kernels; use device: cpu")
    if kernels == "vllm":
        require_vllm(device)
    elif device != "cpu" and not torch.cuda.is_available():
        raise TicInputError(f"device {device!r} asked for but torch sees no CUDA GPU")
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if attn == "sdpa" and not _supports_sdpa(model_dir):
        attn = "eager"  # a model without attention (Mamba-2) refuses sdpa; eager is its only implementation
    kwargs.update(unquantized_config(model_dir))  # block FP8: master weights from codes * scales, below
    try:
        # a block-FP8 checkpoint's scales are names the unquantized model does not have: no load report for them
        with quiet_transformers() if "config" in kwargs else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, attn_implementation="eager" if kernels in WRAPPED_KERNELS else attn, **kwargs)
        if device != "cpu":
            model.to(device)
        else:  # fresh storage: a memory-mapped checkpoint leaves weights at any offset, and CPU BLAS picks its
            for p in model.parameters():  # path by address (the same bits elsewhere, e.g. a converted copy, differ)
                if p.data_ptr() % 64:
                    p.data = p.data.clone()
        quant = attach_checkpoint(model, model_dir)  # after the move: each copy sits beside its master weight
    except (OSError, ValueError, KeyError) as e:
        raise TicInputError(f"cannot load model from {model_dir}: {str(e).splitlines()[0]}") from None
    model.eval()
    model.requires_grad_(trainable)
    if kernels in WRAPPED_KERNELS:
        apply(model, provider_for(kernels, rollout, kv_cache_dtype), backward, quant)
    return model


def _supports_sdpa(model_dir: Path) -> bool:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir)
        return bool(getattr(AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", True))
    except (OSError, ValueError, KeyError):
        return True  # from_pretrained below reports what is wrong with the model


def padded_batch(seqs: list[list[int]], side: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The padded layout both phases and the locator use: (ids, mask, position ids, start column of each row)."""
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    starts = []
    for b, s in enumerate(seqs):
        start = L - len(s) if side == "left" else 0
        ids[b, start:start + len(s)] = torch.tensor(s)
        mask[b, start:start + len(s)] = 1
        starts.append(start)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device), starts


def packed_row(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One row, position ids restarting per sequence (transformers builds the block-causal mask from them):
    (ids [1, N], position ids [1, N], offset of each sequence)."""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    offsets = [sum(len(s) for s in seqs[:i]) for i in range(len(seqs))]
    return ids.to(device), pos.to(device), offsets


def cache_kwargs(model, cache) -> dict:
    """The KV cache argument under the name this transformers version takes (`cache` from 5.2x on,
    `past_key_values` before), so no release warns or breaks."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def request_generator(seed: int, request_id: int) -> torch.Generator:
    """One sampler per request, seeded by the request alone: batch-mates cannot shift its random stream."""
    return torch.Generator().manual_seed(request_seed(seed, request_id))


def sample_token(logprobs: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    """Exponential-race sampling (argmax p/q, q ~ Exp(1)): exact categorical sampling, per request."""
    if temperature == 0:
        return int(torch.argmax(logprobs))
    q = torch.empty(logprobs.shape[-1], dtype=torch.float32).exponential_(generator=gen)
    return int(torch.argmax(logprobs.float().exp() / q))


class HFEngine(Engine):
    name = "hf"
    switch_keys = ("kernels", "attn_implementation")  # consistent kernels bring their own attention

    def __init__(self, model_dir: Path, dtype: str = "auto", kernels: str = "stock", attn: str = "sdpa",
                 batch_size: int = 8, micro_batch_size: int = 4, padding_side: str = "right",
                 packing: bool = False, device: str = "cpu", shared_model: bool = True, order: str = "given",
                 rollout: RolloutKernels = RolloutKernels(), backward: BackwardConfig | None = None,
                 kv_cache_dtype: str = "auto"):
        self.model_dir = Path(model_dir)
        self.kernels = kernels
        self.dtype = dtype
        self.attn = attn
        self.device = torch.device(device)
        self._load_args = (self.model_dir, dtype, kernels, attn, device, rollout, backward)
        self._kv_cache_dtype = kv_cache_dtype
        self._fp8_rules: dict | None = None  # fp8_rules(), read once
        self.model = load_model(*self._load_args, shared=shared_model, kv_cache_dtype=kv_cache_dtype)
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.padding_side = padding_side
        self.packing = packing
        self.order = order
        self.vocab_size = self.model.config.get_text_config().vocab_size

    @classmethod
    def from_config(cls, side_cfg, model_dir: Path, dtype: str, shared_model: bool = True,
                    rollout: RolloutKernels = RolloutKernels()) -> "HFEngine":
        return cls(model_dir, dtype, side_cfg.kernels, side_cfg.attn_implementation, side_cfg.batch_size,
                   side_cfg.micro_batch_size, side_cfg.padding_side, side_cfg.packing,
                   getattr(side_cfg, "device", "cpu"), shared_model, getattr(side_cfg, "order", "given"),
                   rollout, side_cfg.backward, side_cfg.options.get("kv_cache_dtype", "auto"))

    @classmethod
    def baseline_changes(cls, side_cfg) -> dict:
        return {"kernels": "stock"}

    def fingerprint(self) -> dict:
        return {"engine": self.name, "kernels": self.kernels,
                "attn_implementation": "tic wrapped" if self.kernels in WRAPPED_KERNELS else self.attn,
                "dtype": self.dtype, "device": str(self.device), "batch_size": self.batch_size}

    # -- weight sync (C8/C9) ------------------------------------------------------------------------------
    def _weights(self) -> dict[str, torch.Tensor]:
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def weight_storage(self) -> dict[str, tuple[int, tuple, str]]:
        quant = getattr(getattr(self.model, "_tic_ops", None), "quant", None)  # block-FP8 copies move not either
        return {**{k: (t.data_ptr(), tuple(t.shape), str(t.dtype)) for k, t in self._weights().items()},
                **(quant.storage() if quant is not None else {})}

    @torch.no_grad()
    def load_weights_inplace(self, weights, version: int) -> dict:
        own = dict(self.model.named_parameters())
        seen = set()
        for name, src in (weights.items() if isinstance(weights, dict) else weights):
            dst = own.get(name)
            if dst is None:
                raise TicInputError(f"weight sync: the rollout model has no weight {name!r}")
            if dst.shape != src.shape:
                raise TicInputError(f"weight sync: {name} has shape {tuple(src.shape)}, the rollout model "
                                    f"{tuple(dst.shape)}")
            dst.copy_(src.to(dst.device))  # into the existing storage; dtype cast is the export's rounding
            seen.add(name)
        # weight-derived tensors (fused, transposed or quantized copies) are rebuilt from the new weights
        refreshed = [n for n, m in self.model.named_modules() if callable(getattr(m, "tic_refresh_derived", None))]
        for n in refreshed:
            self.model.get_submodule(n).tic_refresh_derived()
        quant = getattr(getattr(self.model, "_tic_ops", None), "quant", None)
        if quant is not None:  # block FP8: the new weights' codes and scales, written over the old ones
            refreshed += quant.refresh()
        self.weight_version = version
        return {"copied": len(seen), "missing": sorted(set(own) - seen), "refreshed": refreshed,
                "version": version}

    # -- numerics shared by both phases -------------------------------------------------------------
    def logprobs_of(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """float32 logprobs of the logits. The wrapped kernels take them in the dtype the model computed them in,
        as vLLM's sampler does: its V2 runner's kernel sums in another order for bf16 logits than for float32."""
        if temperature not in (0, 1):
            logits = logits.float() / temperature
        if self.kernels in WRAPPED_KERNELS:
            return self.model._tic_ops.log_softmax(logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def _check_ids(self, seqs: list[list[int]]) -> None:
        for s in seqs:
            if not s:
                raise TicInputError("empty prompt")
            if min(s) < 0 or max(s) >= self.vocab_size:
                raise TicInputError(f"token id outside the vocabulary (size {self.vocab_size}): {s}")

    # -- rollout --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        self._check_ids(prompts)
        out: list[Sample] = []
        for i in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[i:i + self.batch_size], sampling,
                                        list(request_ids[i:i + self.batch_size]))
        return out

    @torch.inference_mode()
    def generate_together(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        self._check_ids(prompts)
        return self._generate_batch(prompts, sampling, list(request_ids))

    def _generate_batch(self, prompts, sampling: Sampling, request_ids) -> list[Sample]:
        from transformers import DynamicCache

        B = len(prompts)
        # left padding: every request's next token sits in the last column
        ids, mask, pos, _ = padded_batch(prompts, "left", self.device)
        gens = [request_generator(sampling.seed, r) for r in request_ids]
        cache = DynamicCache(config=self.model.config)
        responses = [[] for _ in range(B)]
        lps = [[] for _ in range(B)]
        step_ids, step_pos = ids, pos
        for _ in range(sampling.max_tokens):
            logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                **cache_kwargs(self.model, cache), use_cache=True).logits[:, -1]
            lp = self.logprobs_of(logits, sampling.temperature).cpu()
            nxt = []
            for b in range(B):
                tok = sample_token(lp[b], sampling.temperature, gens[b])
                responses[b].append(tok)
                lps[b].append(lp[b, tok])
                nxt.append(tok)
            step_ids = torch.tensor(nxt, dtype=torch.long, device=self.device)[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long, device=self.device)], dim=1)
        return [Sample(list(p), responses[b], torch.stack(lps[b]).float(), id=request_ids[b],
                       weight_version=self.weight_version, meta={"engine": self.name, "kernels": self.kernels})
                for b, p in enumerate(prompts)]

    # -- teacher-forced scoring (prefill scoring on the rollout side, recompute on the train side) -----
    @torch.inference_mode()
    def score(self, samples: list[Sample], sampling: Sampling) -> list[torch.Tensor]:
        self._check_ids([s.ids for s in samples])
        out: list[torch.Tensor | None] = [None] * len(samples)
        for group in self.micro_batches(len(samples)):
            for i, lp in zip(group, self._score_chunk([samples[i] for i in group], sampling, self.model)):
                out[i] = lp
        return out

    def micro_batches(self, n: int) -> list[list[int]]:
        """Which of n sequences go through one forward together, in this engine's micro-batch size and order."""
        return micro_batches(n, self.micro_batch_size, self.order)

    def _score_chunk(self, chunk: list[Sample], sampling: Sampling, model) -> list[torch.Tensor]:
        score = self._score_packed if self.packing else self._score_padded
        return score(chunk, sampling, model)

    @torch.no_grad()  # not inference mode: the ids feed the reference's autograd graph (C7)
    def expert_routes(self, sample: Sample) -> dict[str, torch.Tensor]:
        """The top-k expert ids [tokens, k] each MoE block of the wrapped model picks for this sequence's tokens
        (forward alone, unpadded); {} for a model without wrapped MoE blocks. C6 makes them layout-independent."""
        if self.kernels not in WRAPPED_KERNELS:
            return {}
        with capture_routes(self.model) as routes:
            self.model(input_ids=torch.tensor([sample.ids], device=self.device), use_cache=False)
        return {name: torch.cat(calls) for name, calls in routes.items()}

    def fp8_rules(self) -> dict:
        """How the wrapped model's FP8 steps round, read from its provider's operators once (fp8_rule): the scale
        rule of its block-FP8 linears and experts ({"linear": Fp8Rule | None, "experts": ...}) and, over an FP8
        KV cache, its attention's ({"kv_attention": KvRule | None}); None where not identified, {} for a model
        with neither. C2's stock model and C7's reference round by them."""
        ops = getattr(self.model, "_tic_ops", None)
        if ops is None or not ops.quantizes:
            return {}
        if self._fp8_rules is None:
            from tic.harness.kernels import fp8_rule

            p, dtype, quant = ops.provider, next(self.model.parameters()).dtype, ops.quant
            rules = {}
            if quant is not None:
                block = quant.block
                rules["linear"] = fp8_rule.detect_linear(
                    lambda x, c, s: p.fp8_linear(x, c, s, None, block, checkpoint=quant.checkpoint),
                    block, dtype, self.device)
                rules["experts"] = fp8_rule.detect_experts(
                    lambda x, w, i, gu, gus, d, ds: p.fp8_moe_experts(x, w, i, gu, gus, d, ds, block),
                    block, dtype, self.device)
            if ops.rounds_kv_to_fp8:
                rules["kv_attention"] = fp8_rule.detect_kv_attention(
                    lambda q, k, v, mask, scale: p.attention(q, k, v, mask, scale), dtype, self.device)
            self._fp8_rules = rules
        return self._fp8_rules

    def quantizer_inputs(self, sample: Sample) -> dict[str, list]:
        """What the wrapped model's FP8 steps round for this sequence (forward alone, unpadded): each block-FP8
        operator's activation by quantized parameter name, each attention's (q, k, v) over an FP8 KV cache
        (Ops.capture_inputs); {} for a model with neither."""
        ops = getattr(self.model, "_tic_ops", None)
        if ops is None or not ops.quantizes:
            return {}
        with ops.capture_inputs() as seen, torch.no_grad():
            self.model(input_ids=torch.tensor([sample.ids], device=self.device), use_cache=False)
        return dict(seen)

    # -- training: gradients through the same forward ------------------------------------------------------
    def trainable_model(self):
        """The trainable copy of this engine's model (cached) that policy_gradients runs."""
        return load_model(*self._load_args, trainable=True, kv_cache_dtype=self._kv_cache_dtype)

    def policy_gradients(self, samples: list[Sample], sampling: Sampling,
                         advantages: list[float]) -> dict[str, torch.Tensor]:
        """Per-parameter gradients (float32, CPU) of the loss -(1/N) sum_i A_i sum_t logp(i, t) over the valid
        response tokens, through this engine's forward in its configured layout (micro-batches, padding side,
        packing, order), on a trainable copy of the model with the same weights."""
        self._check_ids([s.ids for s in samples])
        model = self.trainable_model()
        model.zero_grad(set_to_none=True)
        n_tokens = sum(int(s.mask.sum()) if s.mask is not None else len(s.response_ids) for s in samples)
        for group in self.micro_batches(len(samples)):
            chunk = [samples[i] for i in group]
            loss = 0.0
            for s, a, lp in zip(chunk, [advantages[i] for i in group], self._score_chunk(chunk, sampling, model)):
                if s.mask is not None:
                    lp = lp * s.mask.to(lp.dtype)
                loss = loss - a * lp.sum() / max(n_tokens, 1)
            loss.backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
                 for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)  # the copies above are the result; the device's gradients are free
        return grads

    def _gather(self, logits_rows: torch.Tensor, targets: list[int], sampling: Sampling) -> torch.Tensor:
        lp = self.logprobs_of(logits_rows, sampling.temperature)
        return lp[torch.arange(len(targets)), torch.tensor(targets)].float().cpu()

    def _score_padded(self, chunk: list[Sample], sampling: Sampling, model) -> list[torch.Tensor]:
        ids, mask, pos, starts = padded_batch([s.ids for s in chunk], self.padding_side, self.device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        out = []
        for b, s in enumerate(chunk):
            P, R = len(s.prompt_ids), len(s.response_ids)
            rows = logits[b, starts[b] + P - 1: starts[b] + P - 1 + R]
            out.append(self._gather(rows, s.response_ids, sampling))
        return out

    def _score_packed(self, chunk: list[Sample], sampling: Sampling, model) -> list[torch.Tensor]:
        ids, pos, offsets = packed_row([s.ids for s in chunk], self.device)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        out = []
        for s, off in zip(chunk, offsets):
            P, R = len(s.prompt_ids), len(s.response_ids)
            out.append(self._gather(logits[off + P - 1: off + P - 1 + R], s.response_ids, sampling))
        return out
