"""Llama 3 with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

The architecture is Hugging Face's ``LlamaForCausalLM`` (pre-RMSNorm decoder, rotary embeddings with optional
Llama 3 frequency scaling, SwiGLU MLP, grouped-query attention, final RMSNorm, tied or untied LM head). Two
backends build it with the same parameter names and state-dict keys:

* ``te``: ``transformer_engine.pytorch.TransformerLayer`` (fused QKV, fused attention, FP8/FP4 recipes), or with
  ``fused_residual_norm`` the project's ``FusedResidualTransformerLayer`` (same parameters; residual adds inside the
  RMSNorm kernels, RoPE inside the QKV projection's buffer; bf16/fp32);
* ``torch``: the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and wherever TE is missing.

``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or ``torch``.

Inputs come as BSHD (``input_ids`` [batch, seq] + ``attention_mask``, left or right padding) or THD (packed
``input_ids`` [1, tokens] with ``cu_seq_lens_q/k`` and ``max_length_q/k``). Training and scoring always run on
packed tokens: BSHD input is unpadded on the way in and re-padded on the way out, and rotary positions restart
at each sequence's first real token (what ``generate`` computes from the attention mask for left padding).

Generation: ``generate`` keeps a Hugging Face ``DynamicCache`` of per-layer keys/values and decodes one token at a
time (greedy, sampling, beam search), on both backends: a cached step runs each layer's own sub-modules (TE's fused
RMSNorm+QKV GEMM, output projection and RMSNorm+SwiGLU MLP, or their torch twins) around an attention over the
cached keys (``NVLlamaModel.forward_cached``, llama_decoding.py). Cached steps run in the weights' dtype (FP8 layers
decode in bf16).

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast


try:  # package import (models/llama3, exported checkpoints)
    from .configuration_llama_te import NVLlamaConfig
    from .fused_residual_layer import FusedResidualTransformerLayer
    from .layer_autocast import LayerAutocast
    from .layer_stack import run_layer_stack
    from .llama_decoding import cached_decoding_step
    from .meta_init import materialize_meta_model
    from .packed_rope import PackedQKVRotary, layers_rotary_pos_emb
    from .packing import FP8_TOKEN_ALIGNMENT, PackedBatch, pack_inputs, token_mean_loss
    from .torch_layers import TransformerLayer as TorchTransformerLayer
    from .torch_layers import is_torch_twin
except ImportError:  # flat copy inside a recipe folder
    from configuration_llama_te import NVLlamaConfig
    from fused_residual_layer import FusedResidualTransformerLayer
    from layer_autocast import LayerAutocast
    from layer_stack import run_layer_stack
    from llama_decoding import cached_decoding_step
    from meta_init import materialize_meta_model
    from packed_rope import PackedQKVRotary, layers_rotary_pos_emb
    from packing import FP8_TOKEN_ALIGNMENT, PackedBatch, pack_inputs, token_mean_loss
    from torch_layers import TransformerLayer as TorchTransformerLayer
    from torch_layers import is_torch_twin

try:
    import transformer_engine.pytorch as te

    _TE_IMPORT_ERROR = None
except Exception as error:  # ImportError, or a broken CUDA install raising at import
    te = None
    _TE_IMPORT_ERROR = error


AUTO_MAP = {
    "AutoConfig": "configuration_llama_te.NVLlamaConfig",
    "AutoModel": "modeling_llama_te.NVLlamaModel",
    "AutoModelForCausalLM": "modeling_llama_te.NVLlamaForCausalLM",
}


def resolve_backend(requested: str) -> str:
    """Map ``auto`` to a concrete backend; refuse ``te`` where it cannot run."""
    te_usable = _TE_IMPORT_ERROR is None and torch.cuda.is_available()
    if requested == "te" and not te_usable:
        reason = f"TransformerEngine failed to import ({_TE_IMPORT_ERROR!r})" if te is None else "no CUDA device"
        raise RuntimeError(f"backend='te' was requested but cannot run here: {reason}. Use backend='torch' or 'auto'.")
    if requested == "auto":
        return "te" if te_usable else "torch"
    return requested


# ------------------------------------------------------------------------------------------------- layers


def rope_inverse_frequencies(config: NVLlamaConfig, device=None) -> torch.Tensor:
    """Llama's inverse frequencies, with the Llama 3 (3.1) long-context scaling when rope_type is ``llama3``."""
    rope = config.rope_parameters or {}
    base = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    dim = config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if rope.get("rope_type", "default") != "llama3":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = (old_context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    is_medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(is_medium, interpolated, scaled)


class NVLlamaRotaryEmbedding(nn.Module):
    """Rotary frequencies as TE expects them: [seq, 1, 1, head_dim] in float32 (cat(freqs, freqs) layout)."""

    def __init__(self, config: NVLlamaConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq = rope_inverse_frequencies(self.config, self.inv_freq.device)

    def forward(self, max_seqlen: int) -> torch.Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # model.to(bfloat16) cast the buffer: recompute rather than round angles
            inv_freq = rope_inverse_frequencies(self.config, inv_freq.device)
        positions = torch.arange(max_seqlen, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs, freqs), dim=-1).view(max_seqlen, 1, 1, self.head_dim)


def _build_layers(config: NVLlamaConfig, backend: str) -> nn.ModuleList:
    layer_class = TorchTransformerLayer
    if backend == "te":
        layer_class = FusedResidualTransformerLayer if config.fused_residual_norm else te.TransformerLayer
    std = config.initializer_range
    output_std = std / math.sqrt(2 * config.num_hidden_layers) if config.scale_output_projection_init else std

    def init_method(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=std)

    def output_layer_init_method(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=output_std)

    device_kwargs = {}
    if backend == "te":  # TE allocates on CUDA unless told otherwise; honour a meta-device context
        device_kwargs["device"] = "meta" if torch.empty(0).device.type == "meta" else "cuda"
    return nn.ModuleList(
        layer_class(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_gqa_groups=config.num_key_value_heads,
            kv_channels=config.head_dim,
            layernorm_epsilon=config.rms_norm_eps,
            hidden_dropout=0.0,
            attention_dropout=config.attention_dropout or 0.0,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            layer_number=index + 1,
            self_attn_mask_type="padding_causal",
            layer_type="encoder",  # TE's name for a self-attention-only block (no cross-attention)
            normalization="RMSNorm",
            activation="swiglu",
            bias=False,
            fuse_qkv_params=True,
            qkv_weight_interleaved=True,
            attn_input_format="thd",
            params_dtype=config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32,
            **device_kwargs,
        )
        for index in range(config.num_hidden_layers)
    )


class RMSNorm(nn.Module):
    """Llama's final RMSNorm (statistics in float32), parameter ``weight``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden.dtype)


def _is_backend_layer(module: nn.Module) -> bool:
    """A TE or torch_layers module that owns parameters and knows how to initialise them."""
    origin = type(module).__module__
    return (
        hasattr(module, "reset_parameters")
        and (
            origin.startswith("transformer_engine")
            or is_torch_twin(module)
            or origin == FusedResidualTransformerLayer.__module__
        )
        and any(True for _ in module.parameters(recurse=False))
    )


class NVLlamaPreTrainedModel(PreTrainedModel):
    config_class = NVLlamaConfig
    config: NVLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerLayer", "FusedResidualTransformerLayer"]
    # gradient_checkpointing_enable() recomputes every layer's activations (see config.recompute_layers).
    supports_gradient_checkpointing = True
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding) and self.config.embedding_init_std is not None:
            nn.init.normal_(module.weight, mean=0.0, std=self.config.embedding_init_std)
        elif isinstance(module, nn.Embedding | nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, NVLlamaRotaryEmbedding) or _is_backend_layer(module):
            module.reset_parameters()

    def init_empty_weights(self, device: torch.device | str | None = None) -> None:
        """Materialise a meta-device model (FSDP2-sharded or not) on ``device`` and initialise every weight.

        Build the model under ``torch.device("meta")``, shard it, then call this: parameters are allocated
        shard by shard and initialised with the same distributions as direct construction.
        """
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        materialize_meta_model(self, device, self._init_weights)
        if self.config.tie_word_embeddings:
            self.tie_weights()


class NVLlamaModel(NVLlamaPreTrainedModel):
    """The Llama decoder stack. ``forward`` returns ``last_hidden_state`` in the caller's layout."""

    def __init__(self, config: NVLlamaConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = _build_layers(config, self.backend)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = NVLlamaRotaryEmbedding(config)
        # The fused layers rotate queries and keys inside their QKV projections (packed_rope.py); TE's and the torch
        # layers take the rotary table.
        self.qkv_rotary = None
        if self.backend == "te" and config.fused_residual_norm:
            self.qkv_rotary = PackedQKVRotary.for_layers(
                self.layers,
                config.num_attention_heads,
                config.head_dim,
                "fused_residual_norm",
                num_groups=config.num_key_value_heads,
            )
        self.layer_precision = list(config.layer_precision or [None] * config.num_hidden_layers)
        self._recipes = {"fp8": fp8_recipe, "fp4": fp4_recipe}
        self.gradient_checkpointing = False  # set by Hugging Face's gradient_checkpointing_enable()
        for precision in set(self.layer_precision) - {None}:
            if self._recipes[precision] is None:
                raise ValueError(f"config.layer_precision asks for {precision} but no {precision}_recipe was passed")
            if self.backend != "te":
                raise ValueError(f"{precision} layers need the TransformerEngine backend (this model uses 'torch')")
        self.cp_group = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split every attention over ``cp_group``: TE's ring attention, or on the torch backend an all-gathered
        attention with the same results (for CPU tests; it costs ``cp_size`` times the attention compute).

        Batches must then be THD and already split (see ``packing._pack_context_parallel``), with ``shift_labels``."""
        for layer in self.layers:
            layer.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group = cp_group

    def _layer_autocast(self) -> LayerAutocast:
        """TE autocast regions for the layer loop: one per run of layers with the same ``layer_precision``
        (layer_autocast.py)."""
        return LayerAutocast(self.layer_precision, self._recipes, te.autocast if self.backend == "te" else None)

    def _alignment(self) -> int:
        return FP8_TOKEN_ALIGNMENT if any(p is not None for p in self.layer_precision) else 1

    def pack(
        self,
        input_ids,
        attention_mask=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        cu_seq_lens_q_padded=None,
        leading_full_sequences=0,
    ) -> PackedBatch:
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        return pack_inputs(
            input_ids,
            attention_mask,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            pad,
            self._alignment(),
            cu_seq_lens_q_padded,
            self.cp_group,
            leading_full_sequences,
        )

    def forward_packed(self, packed: PackedBatch, output_hidden_states: bool = False):
        """Run the decoder on packed tokens: returns ([tokens, hidden], tuple of per-layer inputs or None)."""
        hidden = self.embed_tokens(packed.input_ids)
        fused = self.backend == "te" and self.config.fused_residual_norm
        rotary = layers_rotary_pos_emb(self.qkv_rotary, packed, self.rotary_emb(packed.max_seqlen), False, fused)
        # Full windows first (the recipes' THD collators): the fused layers attend over them as one dense batch.
        dense = {"leading_full_sequences": packed.leading_full_sequences} if fused else {}
        hidden, all_hidden = run_layer_stack(
            self,
            self.layers,
            hidden,
            self._layer_autocast(),
            defer_residual=fused,
            output_hidden_states=output_hidden_states,
            rotary_pos_emb=rotary,
            **packed.layer_boundaries(),
            **dense,
        )
        hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden.append(hidden)
        return hidden, (tuple(all_hidden) if output_hidden_states else None)

    def forward_cached(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values: Cache,
    ) -> torch.Tensor:
        """One decoding step on BSHD input with a key/value cache (either backend): returns [batch, new, hidden]
        (llama_decoding.py). ``attention_mask`` covers cached and new tokens ([batch, past + new]), as ``generate``
        passes it."""
        return cached_decoding_step(self, input_ids, attention_mask, position_ids, past_key_values)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        cu_seq_lens_q_padded: torch.Tensor | None = None,
        cu_seq_lens_k_padded: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        leading_full_sequences: int = 0,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``position_ids`` are used with a cache only; packed runs restart positions at each sequence's first
        real token, which is what ``generate`` computes for left- or right-padded batches.

        ``leading_full_sequences`` (THD): the first this many sequences are ``max_length_q`` tokens long, which the
        recipes' collators arrange; the fused layers then attend over them as one dense batch (faster in cuDNN)."""
        if _wants_cache(past_key_values, use_cache):
            past_key_values = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
            hidden = self.forward_cached(input_ids, attention_mask, position_ids, past_key_values)
            return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values)
        packed = self.pack(
            input_ids,
            attention_mask,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            cu_seq_lens_q_padded,
            leading_full_sequences,
        )
        hidden, all_hidden = self.forward_packed(packed, bool(output_hidden_states))
        return BaseModelOutputWithPast(
            last_hidden_state=packed.unpack(hidden),
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


def _wants_cache(past_key_values: Cache | None, use_cache: bool | None) -> bool:
    """The cached path runs when a cache is passed or ``use_cache=True`` is explicit (``generate`` does both).
    ``config.use_cache`` alone does not switch a training forward to it."""
    return past_key_values is not None or use_cache is True


class NVLlamaForCausalLM(NVLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Takes context-parallel shards (model.set_context_parallel_group + cu_seq_lens_q_padded + shift_labels).
    supports_context_parallel = True

    def __init__(self, config: NVLlamaConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.model = NVLlamaModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        # Always in the model's own dtype (never quantized): it runs outside the per-layer precision contexts.
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.model.backend

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The GEMM runs over the padded vocabulary; the padding columns are cut before anyone sees them.
        return self.lm_head(hidden)[..., : self.config.vocab_size]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        shift_labels: torch.Tensor | None = None,
        cu_seq_lens_q_padded: torch.Tensor | None = None,
        cu_seq_lens_k_padded: torch.Tensor | None = None,
        leading_full_sequences: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Next-token logits; ``labels`` are the input tokens (shifted inside, per sequence, as Hugging Face does).

        ``shift_labels`` (Hugging Face's name) are targets already shifted: token i is scored on ``shift_labels[i]``.
        Context-parallel shards need them, since a shard's next token may live on another rank.
        ``leading_full_sequences``: as in ``NVLlamaModel.forward``.
        """
        if labels is not None and shift_labels is not None:
            raise ValueError("pass labels (shifted inside) or shift_labels (already shifted), not both")
        if _wants_cache(past_key_values, use_cache):
            if labels is not None or shift_labels is not None:
                raise ValueError("labels cannot be combined with a KV cache; pass use_cache=False to compute a loss")
            out = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache=True)
            hidden = out.last_hidden_state
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            return CausalLMOutputWithPast(logits=self._logits(hidden), past_key_values=out.past_key_values)
        packed = self.model.pack(
            input_ids,
            attention_mask,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            cu_seq_lens_q_padded,
            leading_full_sequences,
        )
        if packed.cp_group is not None and labels is not None:
            raise ValueError(
                "under context parallelism pass shift_labels (targets shifted to the next token before the batch "
                "was split over ranks), not labels"
            )
        hidden, all_hidden = self.model.forward_packed(packed, bool(output_hidden_states))
        logits = self._logits(hidden)
        loss = None
        if labels is not None:
            loss = token_mean_loss(logits, packed.next_token_labels(labels))
        elif shift_labels is not None:
            loss = token_mean_loss(logits, packed.pack_like(shift_labels), packed.cp_group)
        logits = packed.unpack(logits)
        if logits_to_keep:
            logits = logits[..., -logits_to_keep:, :]
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )
