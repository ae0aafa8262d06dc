"""AMPLIFY with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

The architecture is that of the published AMPLIFY checkpoints (Fournier et al., 2024; chandar-lab/AMPLIFY_120M and
AMPLIFY_350M): a pre-norm encoder with RMSNorm before attention and before the FFN, bias-free Q/K/V/output
projections, rotary embeddings, a bias-free SwiGLU FFN of width ``intermediate_size * 2/3`` rounded up to a multiple
of 8, an optional RMSNorm after the embedding, a final RMSNorm, and an untied decoder with a bias. Two backends build
it with the same parameter names and state-dict keys:

* ``te``: ``transformer_engine.pytorch.TransformerLayer`` (fused RMSNorm + QKV GEMM, fused attention, fused
  RMSNorm + SwiGLU MLP, FP8/FP4 recipes);
* ``torch``: the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and wherever TE is missing.

``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or ``torch``.

Rotary layout. The published model rotates channel pairs ``(2i, 2i + 1)`` of every head (the complex-number form).
This model rotates pairs ``(i, i + head_dim / 2)`` (the half-split form of TE's default fused RoPE and of the torch
twin), and the conversion (``convert.py``) permutes the rows of the Q and K weights to match: channel ``2i`` of a
published head becomes channel ``i``, channel ``2i + 1`` becomes ``i + head_dim / 2``. Attention scores are dot
products over the channels of Q and K, so permuting both the same way changes no number (V and the output projection
are untouched). Why not rotate interleaved pairs instead: the half-split form is what every supported TE release
fuses for BSHD, THD and context parallelism alike, and it needs no change to the shared layers; the reference
comparison in the tests runs the published, interleaved form and proves the two equal.

Inputs come as BSHD (``input_ids`` [batch, seq] + ``attention_mask``) or THD (packed ``input_ids`` [1, tokens] with
``cu_seq_lens_q/k`` and ``max_length_q/k``). The encoder always runs on packed tokens: BSHD input is unpadded on the
way in and re-padded on the way out, so no compute is spent on padding and no token attends across a sequence.

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput


try:  # package import (models/amplify, exported checkpoints)
    from .configuration_amplify_te import NVAmplifyConfig
    from .fused_residual_layer import FusedResidualTransformerLayer
    from .layer_autocast import LayerAutocast
    from .layer_stack import run_layer_stack
    from .meta_init import materialize_meta_model
    from .packed_rope import PackedQKVRotary, layers_rotary_pos_emb
    from .packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs
    from .te_attention import call_cudnn_directly, split_packed_qkv
    from .torch_layers import TransformerLayer as TorchTransformerLayer
    from .torch_layers import is_torch_twin
except ImportError:  # flat copy inside a recipe folder
    from configuration_amplify_te import NVAmplifyConfig
    from fused_residual_layer import FusedResidualTransformerLayer
    from layer_autocast import LayerAutocast
    from layer_stack import run_layer_stack
    from meta_init import materialize_meta_model
    from packed_rope import PackedQKVRotary, layers_rotary_pos_emb
    from packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs
    from te_attention import call_cudnn_directly, split_packed_qkv
    from torch_layers import TransformerLayer as TorchTransformerLayer
    from torch_layers import is_torch_twin

try:
    import transformer_engine.pytorch as te

    _TE_IMPORT_ERROR = None
except Exception as error:  # ImportError, or a broken CUDA install raising at import
    te = None
    _TE_IMPORT_ERROR = error


AUTO_MAP = {
    "AutoConfig": "configuration_amplify_te.NVAmplifyConfig",
    "AutoModel": "modeling_amplify_te.NVAmplifyModel",
    "AutoModelForMaskedLM": "modeling_amplify_te.NVAmplifyForMaskedLM",
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


class NVAmplifyRotaryEmbedding(nn.Module):
    """Rotary angles as TE expects them: [seq, 1, 1, head_dim] float32, half-split (cat(freqs, freqs)) layout."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.base**exponents)

    def reset_parameters(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, max_seqlen: int) -> torch.Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # model.to(bfloat16) cast the buffer: recompute rather than round angles
            inv_freq = self._inv_freq(inv_freq.device)
        positions = torch.arange(max_seqlen, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs, freqs), dim=-1).view(max_seqlen, 1, 1, self.head_dim)


def _uniform_init(half_width: float):
    def init_method(weight: torch.Tensor) -> None:
        nn.init.uniform_(weight, -half_width, half_width)

    return init_method


def _build_layers(config: NVAmplifyConfig, backend: str) -> nn.ModuleList:
    layer_class = TorchTransformerLayer
    if backend == "te":
        layer_class = FusedResidualTransformerLayer if config.fused_residual_norm else te.TransformerLayer
    init_method = _uniform_init(config.decoder_init_range)
    device_kwargs = {}
    if backend == "te":  # TE allocates on CUDA unless told otherwise; honour a meta-device context
        device_kwargs["device"] = "meta" if torch.empty(0).device.type == "meta" else "cuda"
    return nn.ModuleList(
        layer_class(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            num_attention_heads=config.num_attention_heads,
            kv_channels=config.hidden_size // config.num_attention_heads,
            layernorm_epsilon=config.norm_eps,
            hidden_dropout=config.dropout_prob,  # the published resid_dropout and ffn_dropout
            attention_dropout=config.dropout_prob,
            init_method=init_method,
            output_layer_init_method=init_method,
            layer_number=index + 1,
            self_attn_mask_type="padding",
            layer_type="encoder",
            # attention_norm -> layernorm_qkv's RMSNorm, ffn_norm -> layernorm_mlp's RMSNorm; w12 -> fc1 (SwiGLU
            # gates with the first half, as the published FFN does), w3 -> fc2.
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


class NVAmplifyPreTrainedModel(PreTrainedModel):
    config_class = NVAmplifyConfig
    config: NVAmplifyConfig
    base_model_prefix = "amplify"
    _no_split_modules = ["TransformerLayer", "FusedResidualTransformerLayer"]
    # gradient_checkpointing_enable() recomputes every layer's activations (see config.recompute_layers).
    supports_gradient_checkpointing = True
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # The published init: uniform draws for every linear and the embedding (its padding row included), zero
        # biases, unit norm scales.
        if isinstance(module, nn.Embedding):
            nn.init.uniform_(module.weight, -self.config.embedding_init_range, self.config.embedding_init_range)
        elif isinstance(module, nn.Linear):
            nn.init.uniform_(module.weight, -self.config.decoder_init_range, self.config.decoder_init_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, NVAmplifyRotaryEmbedding) or _is_backend_layer(module):
            module.reset_parameters()

    def init_empty_weights(self, device: torch.device | str | None = None) -> None:
        """Materialise a meta-device model (FSDP2-sharded or not) on ``device`` and initialise every weight.

        Build the model under ``torch.device("meta")``, shard it, then call this: parameters are allocated
        shard by shard and initialised with the same distributions as direct construction.
        """
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        materialize_meta_model(self, device, self._init_weights)


class NVAmplifyModel(NVAmplifyPreTrainedModel):
    """The AMPLIFY encoder. ``last_hidden_state`` is what the decoder reads: after ``final_norm`` (the published
    ``layer_norm_2``) when ``layer_norm_before_last_layer`` is set."""

    def __init__(self, config: NVAmplifyConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        # Norms outside the transformer layers run in high precision on both backends (torch's own RMSNorm).
        self.embedding_norm = (
            nn.RMSNorm(config.hidden_size, eps=config.norm_eps) if config.layer_norm_after_embedding else None
        )
        self.layers = _build_layers(config, self.backend)
        self.final_norm = (
            nn.RMSNorm(config.hidden_size, eps=config.norm_eps) if config.layer_norm_before_last_layer else None
        )
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_embeddings = NVAmplifyRotaryEmbedding(head_dim, config.rope_theta)
        # TE backend: rotary embeddings applied inside the QKV projections (packed_rope.py); None: in the layers.
        self.qkv_rotary = None
        if self.backend == "te":
            self.qkv_rotary = PackedQKVRotary.for_layers(
                self.layers,
                config.num_attention_heads,
                head_dim,
                "fused_residual_norm" if config.fused_residual_norm else None,
            )
            if self.qkv_rotary is not None and not config.fused_residual_norm:  # q/k/v as views of the rotated buffer
                split_packed_qkv(self.layers)
                # cuDNN's attention without DotProductAttention's Python per call (FP8 runs are host-bound)
                call_cudnn_directly(self.layers)
        self.layer_precision = list(config.layer_precision or [None] * config.num_hidden_layers)
        self.cp_group = None
        self.gradient_checkpointing = False  # set by Hugging Face's gradient_checkpointing_enable()
        self._recipes = {"fp8": fp8_recipe, "fp4": fp4_recipe}
        for precision in set(self.layer_precision) - {None}:
            if self._recipes[precision] is None:
                raise ValueError(f"config.layer_precision asks for {precision} but no {precision}_recipe was passed")
            if self.backend != "te":
                raise ValueError(f"{precision} layers need the TransformerEngine backend (this model uses 'torch')")
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split every attention over ``cp_group``: TE's ring attention, or on the torch backend an all-gathered
        attention with the same results (for CPU tests; it costs ``cp_size`` times the attention compute)."""
        for layer in self.layers:
            layer.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group = cp_group

    def _layer_autocast(self) -> LayerAutocast:
        """TE autocast regions for the layer loop: one per run of layers with the same ``layer_precision``
        (layer_autocast.py)."""
        return LayerAutocast(self.layer_precision, self._recipes, te.autocast if self.backend == "te" else None)

    def _alignment(self) -> int:
        return FP8_TOKEN_ALIGNMENT if any(p is not None for p in self.layer_precision) else 1

    def forward_packed(self, packed: PackedBatch, output_hidden_states: bool = False):
        """Run the encoder on packed tokens: returns ([tokens, hidden], tuple of per-layer inputs or None)."""
        hidden = self.embeddings(packed.input_ids)
        if self.embedding_norm is not None:
            hidden = self.embedding_norm(hidden)
        config = self.config
        rotary = layers_rotary_pos_emb(
            self.qkv_rotary,
            packed,
            self.rotary_embeddings(packed.max_seqlen),
            config.fused_qkv_rope,
            config.fused_residual_norm,
        )
        hidden, all_hidden = run_layer_stack(
            self,
            self.layers,
            hidden,
            self._layer_autocast(),
            defer_residual=self.backend == "te" and config.fused_residual_norm,
            output_hidden_states=output_hidden_states,
            rotary_pos_emb=rotary,
            **packed.layer_boundaries(),
        )
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        if output_hidden_states:
            all_hidden.append(hidden)
        return hidden, (tuple(all_hidden) if output_hidden_states else None)

    def pack(
        self,
        input_ids,
        attention_mask=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        cu_seq_lens_q_padded=None,
    ) -> PackedBatch:
        return pack_inputs(
            input_ids,
            attention_mask,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            self.config.pad_token_id,
            self._alignment(),
            cu_seq_lens_q_padded,
            self.cp_group,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        cu_seq_lens_q_padded: torch.Tensor | None = None,
        cu_seq_lens_k_padded: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        packed = self.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q, cu_seq_lens_q_padded)
        hidden, all_hidden = self.forward_packed(packed, bool(output_hidden_states))
        return BaseModelOutput(
            last_hidden_state=packed.unpack(hidden),
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


class NVAmplifyForMaskedLM(NVAmplifyPreTrainedModel):
    """The encoder and the published untied ``decoder`` (linear with bias to the vocabulary), in high precision."""

    def __init__(self, config: NVAmplifyConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.amplify = NVAmplifyModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.amplify.backend

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.decoder = value

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        # The GEMM runs over the padded vocabulary; the padding columns are cut before anyone sees them.
        return self.decoder(hidden)[..., : self.config.vocab_size]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        cu_seq_lens_q_padded: torch.Tensor | None = None,
        cu_seq_lens_k_padded: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        labeled_logits_only: bool = False,
        labeled_token_index: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """``labeled_logits_only=True`` (the training loops) runs the decoder only on the masked tokens and returns
        their logits as [labelled tokens, vocab] in packed order; the loss is the same
        (``packing.head_logits_and_loss``). ``labeled_token_index`` (``packing.labeled_token_index`` of the CPU
        batch) names those tokens; without it the forward finds them on the GPU, with one host sync."""
        packed = self.amplify.pack(
            input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q, cu_seq_lens_q_padded
        )
        hidden, all_hidden = self.amplify.forward_packed(packed, bool(output_hidden_states))
        targets = None if labels is None else packed.pack_like(labels)
        logits, loss = head_logits_and_loss(
            self.head, hidden, targets, packed, labeled_logits_only, labeled_token_index
        )
        return MaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )
