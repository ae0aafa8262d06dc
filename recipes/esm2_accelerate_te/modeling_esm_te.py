# Copied from models/esm2/esm2_te/modeling_esm_te.py — edit the source, then run ci/check_copies.py --fix
"""ESM-2 with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

The architecture is Hugging Face's ``EsmForMaskedLM`` for ESM-2 (pre-LayerNorm encoder, rotary embeddings,
GELU MLP, token dropout with ESM's rescaling, final LayerNorm, tied LM head). Two backends build it with the
same parameter names and state-dict keys:

* ``te``: ``transformer_engine.pytorch.TransformerLayer`` (fused QKV, fused attention, FP8/FP4 recipes);
* ``torch``: the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and wherever TE is missing.

``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or ``torch``.

Inputs come as BSHD (``input_ids`` [batch, seq] + ``attention_mask``) or THD (packed ``input_ids`` [1, tokens]
with ``cu_seq_lens_q/k`` and ``max_length_q/k``, Hugging Face's names for flash-attention style packing). The
encoder always runs on packed tokens: BSHD input is unpadded on the way in and re-padded on the way out, so no
compute is spent on padding and no token attends across a sequence boundary.

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, TokenClassifierOutput


try:  # package import (models/esm2, exported checkpoints)
    from .configuration_esm_te import NVEsmConfig
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
    from configuration_esm_te import NVEsmConfig
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
    "AutoConfig": "configuration_esm_te.NVEsmConfig",
    "AutoModel": "modeling_esm_te.NVEsmModel",
    "AutoModelForMaskedLM": "modeling_esm_te.NVEsmForMaskedLM",
    "AutoModelForTokenClassification": "modeling_esm_te.NVEsmForTokenClassification",
}

# ESM was trained masking 15% of tokens, 80% of those with <mask>; token dropout rescales by this ratio.
_MASK_RATIO_TRAIN = 0.15 * 0.8


def resolve_backend(requested: str) -> str:
    """Map ``auto`` to a concrete backend; refuse ``te`` where it cannot run."""
    te_usable = _TE_IMPORT_ERROR is None and torch.cuda.is_available()
    if requested == "te" and not te_usable:
        reason = f"TransformerEngine failed to import ({_TE_IMPORT_ERROR!r})" if te is None else "no CUDA device"
        raise RuntimeError(f"backend='te' was requested but cannot run here: {reason}. Use backend='torch' or 'auto'.")
    if requested == "auto":
        return "te" if te_usable else "torch"
    return requested


def use_gemm_epilogue_gelu(layers: nn.ModuleList) -> None:
    """Have cuBLAS apply each TE layer's fc1 bias + GELU, and their backward, inside the GEMMs.

    In bf16, TE's ``LayerNormMLP`` by default (``NVTE_BIAS_GELU_NVFUSION=1``) runs bias + GELU after the fc1 GEMM,
    and dGELU + bias grad after the fc2 dgrad GEMM, as torch.compile'd elementwise kernels that each read and write
    the whole [tokens, ffn] activation. The GEMM epilogues compute the same tanh-approximated GELU while the output
    is still on chip. ESM-2 650M, one H100, 48k tokens per step: 34 ms less elementwise work, 23 ms more GEMM time,
    1.3-1.6% more tokens/s in two comparisons, losses equal to the fourth decimal (docs/benchmarks.md). FP8 layers
    use neither path.
    Setting ``NVTE_BIAS_GELU_NVFUSION`` in the environment leaves TE's own choice in place (to compare the two).
    """
    if "NVTE_BIAS_GELU_NVFUSION" in os.environ:
        return
    for layer in layers:
        layer.layernorm_mlp.bias_gelu_nvfusion = False


def _output_and_no_bias(module: nn.Module, args, output: torch.Tensor):
    """Forward hook: ``(output, None)``, the pair ``te.TransformerLayer`` unpacks from a ``return_bias`` module."""
    return output, None


def add_output_biases_in_gemms(layers: nn.ModuleList) -> None:
    """Have each TE layer's attention-output projection (``proj``) and ``fc2`` add their biases in the GEMM, and the
    residual be one plain add, in place of TE's torch.compile'd bias-dropout-add.

    ``te.TransformerLayer`` builds both with ``return_bias=True`` and adds bias, dropout and residual in a compiled
    function that sums the three in fp32 and rounds once. While the biases are far below bf16 resolution (early in
    training) they then decide the ties of that sum: TE's layer output moves hundreds of times further along a tiny
    bias than the bias itself, and the early losses fall faster than the gradient predicts (docs/benchmarks.md, the
    fused layer for ESM-2). Here TE's module adds the bias as for any biased ``te.Linear`` (``apply_bias``: to the
    GEMM's fp32 accumulator) and sums its gradient there too (the weight-gradient GEMM's epilogue in bf16, the
    gradient's FP8 cast kernel in FP8); the layer, handed ``None`` for the bias (the forward hook), adds the residual
    with a plain ``+``. A tiny bias then moves the output by its own size, as in the fused layers. Same speed (ESM-2
    3B and 650M in FP8 on one H200, within 0.1%). Only where the layer's ``hidden_dropout`` is 0 (ESM-2's): with
    dropout, TE's compiled kernel does dropout and add in one pass. Setting ``NVTE_BIAS_DROPOUT_FUSION`` in the
    environment leaves TE's own path (to compare the two).
    """
    if "NVTE_BIAS_DROPOUT_FUSION" in os.environ:
        return
    for layer in layers:
        if layer.hidden_dropout != 0 or getattr(layer, "drop_path", None) is not None:
            continue
        for module in (layer.self_attention.proj, layer.layernorm_mlp):
            if module.use_bias and module.return_bias and not getattr(module, "return_layernorm_output", False):
                module.return_bias, module.apply_bias = False, True
                module.register_forward_hook(_output_and_no_bias)


class NVEsmRotaryEmbedding(nn.Module):
    """Rotary frequencies as TE expects them: [seq, 1, 1, head_dim] in float32 (ESM's cat(freqs, freqs) layout)."""

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


class NVEsmEmbeddings(nn.Module):
    def __init__(self, config: NVEsmConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.padded_vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.token_dropout = config.token_dropout
        self.mask_token_id = config.mask_token_id

    def forward(self, packed: PackedBatch) -> torch.Tensor:
        embeddings = self.word_embeddings(packed.input_ids)
        if not self.token_dropout:
            return embeddings
        # Masked tokens are zeroed and every sequence is rescaled by (1 - train mask ratio) / (1 - its own ratio),
        # as in ESM; the ratio is per sequence, so it is computed per packed segment (and, under context
        # parallelism, summed over the ranks that each hold a share of the sequence).
        is_mask = packed.input_ids == self.mask_token_id
        embeddings = embeddings.masked_fill(is_mask.unsqueeze(-1), 0.0)
        local_lengths = packed.local_segment_lengths()
        sequence_of_token = torch.repeat_interleave(
            torch.arange(local_lengths.numel(), device=local_lengths.device),
            local_lengths,
            output_size=packed.input_ids.numel(),
        )
        masked_per_sequence = torch.zeros(local_lengths.numel(), device=embeddings.device).index_add_(
            0, sequence_of_token, is_mask.float()
        )
        if packed.cp_group is not None:
            torch.distributed.all_reduce(masked_per_sequence, group=packed.cp_group)
        lengths = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
        observed_ratio = masked_per_sequence / lengths.clamp(min=1)
        scale = (1 - _MASK_RATIO_TRAIN) / (1 - observed_ratio)
        return (embeddings * scale[sequence_of_token].unsqueeze(-1)).to(embeddings.dtype)


class NVEsmEncoder(nn.Module):
    def __init__(self, config: NVEsmConfig, backend: str):
        super().__init__()
        self.backend = backend
        layer_class = TorchTransformerLayer
        if backend == "te":
            layer_class = FusedResidualTransformerLayer if config.fused_residual_norm else te.TransformerLayer
        head_dim = config.hidden_size // config.num_attention_heads
        std = config.initializer_range

        def init_method(weight: torch.Tensor) -> None:
            nn.init.normal_(weight, mean=0.0, std=std)

        device_kwargs = {}
        if backend == "te":  # TE allocates on CUDA unless told otherwise; honour a meta-device context
            device_kwargs["device"] = "meta" if torch.empty(0).device.type == "meta" else "cuda"
        self.layers = nn.ModuleList(
            layer_class(
                hidden_size=config.hidden_size,
                ffn_hidden_size=config.intermediate_size,
                num_attention_heads=config.num_attention_heads,
                kv_channels=head_dim,
                layernorm_epsilon=config.layer_norm_eps,
                hidden_dropout=config.hidden_dropout_prob,
                attention_dropout=config.attention_probs_dropout_prob,
                init_method=init_method,
                output_layer_init_method=init_method,
                layer_number=index + 1,
                self_attn_mask_type="padding",
                layer_type="encoder",
                normalization="LayerNorm",
                activation="gelu",
                bias=True,
                fuse_qkv_params=True,
                qkv_weight_interleaved=True,
                attn_input_format="thd",
                params_dtype=config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32,
                **device_kwargs,
            )
            for index in range(config.num_hidden_layers)
        )
        self.qkv_rotary = None  # TE backend: rotary embeddings applied inside the QKV projections (packed_rope.py)
        if backend == "te":
            self.qkv_rotary = PackedQKVRotary.for_layers(
                self.layers,
                config.num_attention_heads,
                head_dim,
                "fused_residual_norm" if config.fused_residual_norm else None,
            )
            if not config.fused_residual_norm:  # (the fused layers run GELU in the GEMMs and split q/k/v themselves)
                use_gemm_epilogue_gelu(self.layers)
                add_output_biases_in_gemms(self.layers)
                if self.qkv_rotary is not None:  # attention reads q/k/v as views of the rotated buffer
                    split_packed_qkv(self.layers)
                    # cuDNN's attention without DotProductAttention's Python per call (FP8 runs are host-bound)
                    call_cudnn_directly(self.layers)
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_embeddings = NVEsmRotaryEmbedding(head_dim, config.rope_theta)


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


class NVEsmPreTrainedModel(PreTrainedModel):
    config_class = NVEsmConfig
    config: NVEsmConfig
    base_model_prefix = "esm"
    _no_split_modules = ["TransformerLayer", "FusedResidualTransformerLayer"]
    # gradient_checkpointing_enable() recomputes every layer's activations (see config.recompute_layers).
    supports_gradient_checkpointing = True
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding | nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, NVEsmLMHead):
            nn.init.zeros_(module.bias)
        elif isinstance(module, NVEsmContactHead):
            nn.init.zeros_(module.regression.weight)
            nn.init.zeros_(module.regression.bias)
        elif isinstance(module, NVEsmRotaryEmbedding) or _is_backend_layer(module):
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


class NVEsmContactHead(nn.Module):
    """Holds ESM-2's contact-regression weights (as buffers: they are not trained here) so that a Hugging Face
    checkpoint survives a round trip through this model unchanged. Contact prediction needs attention maps, which
    fused attention does not produce; run the converted Hugging Face model for that."""

    def __init__(self, config: NVEsmConfig):
        super().__init__()
        self.regression = nn.Module()
        in_features = config.num_hidden_layers * config.num_attention_heads
        # float32 whatever the default dtype (from_pretrained(dtype=torch.bfloat16) builds under a bf16 default)
        self.regression.register_buffer("weight", torch.zeros(1, in_features, dtype=torch.float32))
        self.regression.register_buffer("bias", torch.zeros(1, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """Device moves apply; dtype casts do not. A model-wide ``.to(torch.bfloat16)`` (bf16 training weights,
        Megatron-FSDP's compute weights) would otherwise round the stored weights, and the export would no longer
        hold the checkpoint's values."""
        buffers = self.regression._buffers
        for name, buffer in buffers.items():
            moved = fn(buffer)
            buffers[name] = moved if moved.dtype == buffer.dtype else buffer.to(moved.device)
        return self


class NVEsmModel(NVEsmPreTrainedModel):
    """The ESM-2 encoder. ``forward`` returns ``last_hidden_state`` in the caller's layout."""

    def __init__(self, config: NVEsmConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = NVEsmEmbeddings(config)
        self.encoder = NVEsmEncoder(config, self.backend)
        self.contact_head = NVEsmContactHead(config)
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
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p") -> None:
        """Split every attention over ``cp_group``: TE's ring attention, or on the torch backend an all-gathered
        attention with the same results (for CPU tests; it costs ``cp_size`` times the attention compute)."""
        for layer in self.encoder.layers:
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
        hidden = self.embeddings(packed)
        config = self.config
        rotary = layers_rotary_pos_emb(
            self.encoder.qkv_rotary,
            packed,
            self.encoder.rotary_embeddings(packed.max_seqlen),
            config.fused_qkv_rope,
            config.fused_residual_norm,
        )
        hidden, all_hidden = run_layer_stack(
            self,
            self.encoder.layers,
            hidden,
            self._layer_autocast(),
            defer_residual=self.backend == "te" and config.fused_residual_norm,
            output_hidden_states=output_hidden_states,
            rotary_pos_emb=rotary,
            **packed.layer_boundaries(),
        )
        hidden = self.encoder.emb_layer_norm_after(hidden)
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


class NVEsmLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder tied to the input embeddings (+ bias). Always in high precision."""

    def __init__(self, config: NVEsmConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(F.gelu(self.dense(hidden)))
        # The GEMM runs over the padded vocabulary; the padding columns are cut before anyone sees them.
        return (self.decoder(x) + self.bias)[..., : self.vocab_size]


class _NVEsmPerTokenModel(NVEsmPreTrainedModel):
    """The forward shared by heads that predict one output per token: pack, encode, head, loss, unpack."""

    output_class = MaskedLMOutput

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
    ):
        """``labeled_logits_only=True`` (the training loops) runs the head only on the tokens that have a label and
        returns their logits as [labelled tokens, classes] in packed order; the loss is the same
        (``packing.head_logits_and_loss``). ``labeled_token_index`` (``packing.labeled_token_index`` of the CPU
        batch) names those tokens; without it the forward finds them on the GPU, with one host sync."""
        packed = self.esm.pack(
            input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q, cu_seq_lens_q_padded
        )
        hidden, all_hidden = self.esm.forward_packed(packed, bool(output_hidden_states))
        targets = None if labels is None else packed.pack_like(labels)
        logits, loss = head_logits_and_loss(
            self.head, hidden, targets, packed, labeled_logits_only, labeled_token_index
        )
        return self.output_class(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


class NVEsmForMaskedLM(_NVEsmPerTokenModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "esm.embeddings.word_embeddings.weight"}
    output_class = MaskedLMOutput

    def __init__(self, config: NVEsmConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.esm = NVEsmModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.lm_head = NVEsmLMHead(config)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.esm.backend

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class NVEsmForTokenClassification(_NVEsmPerTokenModel):
    output_class = TokenClassifierOutput

    def __init__(self, config: NVEsmConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.esm = NVEsmModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(hidden))
