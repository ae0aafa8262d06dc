# Copied from models/codonfm/codonfm_te/modeling_codonfm_te.py — edit the source, then run ci/check_copies.py --fix
"""CodonFM's Encodon with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

Encodon (NVIDIA, 2025; CodonFM) is a masked language model over codons: 69 tokens (5 special, 64 codons), an
embedding with a LayerNorm, rotary self-attention and an untied MLM head. Its layers are not the standard pre-norm
block: each has four LayerNorms (MAGNETO's "Sub-LN"), one before and one inside each sub-layer::

    x = x + dropout(post_attn_dense(post_attn_layer_norm(attention(pre_attn_layer_norm(x)))))
    x = x + dropout(output_dense(post_ffn_layer_norm(act(intermediate_dense(pre_ffn_layer_norm(x))))))

so no ``te.TransformerLayer`` describes it. ``EncodonLayer`` (encodon_layer.py) builds it from TE's pieces instead, each LayerNorm fused
into the GEMM that follows it (``te.LayerNormLinear``):

* ``self_attention.layernorm_qkv``: pre-attention LayerNorm + the Q, K, V projections (one fused weight, TE's
  interleaved per-head row layout: head ``h``'s query, key and value rows one after the other);
* ``self_attention.core_attention``: ``te.DotProductAttention`` on packed tokens (``thd``), padding mask, rotary
  embeddings on Q and K (the half-split ``rotate_half`` layout, positions from 0 in every sequence);
* ``self_attention.proj``: post-attention LayerNorm + the output projection (``post_attn_dense``);
* ``mlp.fc1``: pre-FFN LayerNorm + ``intermediate_dense``; the activation (exact GELU by default);
* ``mlp.fc2``: post-FFN LayerNorm (over the intermediate width) + ``output_dense``.

Two backends build it with the same parameter names and state-dict keys: ``te`` (TransformerEngine's modules, fused
RoPE, FP8/FP4 recipes per layer) and ``torch`` (the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and
wherever TE is missing). ``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or
``torch``. The rotary table is computed here for both backends in float32 (TE's ``RotaryPositionEmbedding`` allocates
its buffer on the current CUDA device, which rules out meta-device construction and CPUs).

Init is MAGNETO's (Wang et al. 2022, as in the published ``EnCodon._init_weights``): every linear weight is
Xavier-normal with gain ``initializer_range * sqrt(log(2 * num_hidden_layers))``, except the query and key projections
(gain 1); biases 0, LayerNorms 1/0, the embedding normal(0, ``initializer_range``) with the padding row zeroed.

Inputs come as BSHD (``input_ids`` [batch, seq] + ``attention_mask``) or THD (packed ``input_ids`` [1, tokens] with
``cu_seq_lens_q/k`` and ``max_length_q/k``). The encoder always runs on packed tokens: BSHD input is unpadded on the
way in and re-padded on the way out, so no compute is spent on padding and no sequence attends to another.

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput


try:  # package import (models/codonfm, exported checkpoints)
    from .configuration_codonfm_te import NVEncodonConfig
    from .encodon_layer import (
        EncodonLayer,
        NVEncodonRotaryEmbedding,
        apply_activation,
        magneto_init_,
        tag_magneto_role,
    )
    from .layer_autocast import LayerAutocast
    from .layer_stack import run_layer_stack
    from .meta_init import materialize_meta_model
    from .packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs
except ImportError:  # flat copy inside a recipe folder
    from configuration_codonfm_te import NVEncodonConfig
    from encodon_layer import EncodonLayer, NVEncodonRotaryEmbedding, apply_activation, magneto_init_, tag_magneto_role
    from layer_autocast import LayerAutocast
    from layer_stack import run_layer_stack
    from meta_init import materialize_meta_model
    from packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs

try:
    import transformer_engine.pytorch as te

    _TE_IMPORT_ERROR = None
except Exception as error:  # ImportError, or a broken CUDA install raising at import
    te = None
    _TE_IMPORT_ERROR = error


AUTO_MAP = {
    "AutoConfig": "configuration_codonfm_te.NVEncodonConfig",
    "AutoModel": "modeling_codonfm_te.NVEncodonModel",
    "AutoModelForMaskedLM": "modeling_codonfm_te.NVEncodonForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_codonfm_te.NVEncodonForSequenceClassification",
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


class NVEncodonEmbeddings(nn.Module):
    """Codon embedding (padding row ``pad_token_id``), LayerNorm, dropout; no position embedding (rotary)."""

    def __init__(self, config: NVEncodonConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.padded_vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.layer_norm(self.word_embeddings(input_ids)), self.dropout, self.training)


# ----------------------------------------------------------------------------------------------------------- models


class NVEncodonPreTrainedModel(PreTrainedModel):
    config_class = NVEncodonConfig
    config: NVEncodonConfig
    base_model_prefix = "encodon"
    _no_split_modules = ["EncodonLayer"]
    # gradient_checkpointing_enable() recomputes every layer's activations (see config.recompute_layers).
    supports_gradient_checkpointing = True
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """MAGNETO (see the module docstring), module by module: each module knows its role from its tag."""
        role = getattr(module, "magneto_role", None)
        if role is not None:  # nn.Linear, or a (TE or twin) LayerNormLinear
            if getattr(module, "layer_norm_weight", None) is not None:
                nn.init.ones_(module.layer_norm_weight)
                nn.init.zeros_(module.layer_norm_bias)
            magneto_init_(module.weight, role, self.config)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, NVEncodonRotaryEmbedding):
            module.reset_parameters()

    def init_empty_weights(self, device: torch.device | str | None = None) -> None:
        """Materialise a meta-device model (FSDP2-sharded or not) on ``device`` and initialise every weight.

        Build the model under ``torch.device("meta")``, shard it, then call this: parameters are allocated
        shard by shard and initialised with the same distributions as direct construction.
        """
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        materialize_meta_model(self, device, self._init_weights)


class NVEncodonModel(NVEncodonPreTrainedModel):
    """The Encodon encoder. ``last_hidden_state`` is the last layer's output (the published model has no final norm:
    the MLM head normalises inside), in the caller's layout."""

    def __init__(self, config: NVEncodonConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = NVEncodonEmbeddings(config)
        self.layers = nn.ModuleList(
            EncodonLayer(config, self.backend, index + 1) for index in range(config.num_hidden_layers)
        )
        self.rotary_embeddings = NVEncodonRotaryEmbedding(config.head_dim, config.rotary_theta)
        self.layer_precision = list(config.layer_precision or [None] * config.num_hidden_layers)
        self._recipes = {"fp8": fp8_recipe, "fp4": fp4_recipe}
        self.gradient_checkpointing = False  # set by Hugging Face's gradient_checkpointing_enable()
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

    def _layer_autocast(self) -> LayerAutocast:
        """TE autocast regions for the layer loop: one per run of layers with the same ``layer_precision``
        (layer_autocast.py)."""
        return LayerAutocast(self.layer_precision, self._recipes, te.autocast if self.backend == "te" else None)

    def _alignment(self) -> int:
        return FP8_TOKEN_ALIGNMENT if any(p is not None for p in self.layer_precision) else 1

    def pack(self, input_ids, attention_mask=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None):
        return pack_inputs(
            input_ids,
            attention_mask,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            self.config.pad_token_id,
            self._alignment(),
        )

    def forward_packed(self, packed: PackedBatch, output_hidden_states: bool = False):
        """Run the encoder on packed tokens: returns ([tokens, hidden], tuple of per-layer inputs and the last output,
        or None)."""
        hidden = self.embeddings(packed.input_ids)
        rotary = self.rotary_embeddings(packed.max_seqlen)
        hidden, all_hidden = run_layer_stack(
            self,
            self.layers,
            hidden,
            self._layer_autocast(),
            defer_residual=False,
            output_hidden_states=output_hidden_states,
            rotary=rotary,
            cu_seqlens=packed.cu_seqlens,
            max_seqlen=packed.max_seqlen,
        )
        if output_hidden_states:
            all_hidden.append(hidden)
        return hidden, (tuple(all_hidden) if output_hidden_states else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        packed = self.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        hidden, all_hidden = self.forward_packed(packed, bool(output_hidden_states))
        return BaseModelOutput(
            last_hidden_state=packed.unpack(hidden),
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


class NVEncodonLMHead(nn.Module):
    """The published ``cls``: dense -> GELU -> LayerNorm -> decoder (untied, with bias). Always in high precision."""

    def __init__(self, config: NVEncodonConfig):
        super().__init__()
        self.dense = tag_magneto_role(nn.Linear(config.hidden_size, config.hidden_size), "linear")
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = tag_magneto_role(nn.Linear(config.hidden_size, config.padded_vocab_size), "decoder")
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(apply_activation(self.dense(hidden), "gelu"))
        # The GEMM runs over the padded vocabulary; the padding columns are cut before anyone sees them.
        return self.decoder(x)[..., : self.vocab_size]


class NVEncodonForMaskedLM(NVEncodonPreTrainedModel):
    def __init__(self, config: NVEncodonConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.encodon = NVEncodonModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.lm_head = NVEncodonLMHead(config)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.encodon.backend

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        labeled_logits_only: bool = False,
        labeled_token_index: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """The masked-LM forward. ``labeled_logits_only=True`` (training) runs the head only on the tokens that have a
        label (the ~15% masked codons) and returns their logits as [labeled tokens, vocab], in packed order; the loss
        is the same as with every token's logits, without the head's GEMMs and the float32 softmax on rows the loss
        never reads. ``labeled_token_index`` (``packing.labeled_token_index`` of the CPU batch) names those tokens;
        without it the forward finds them on the GPU, with one host sync."""
        packed = self.encodon.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        hidden, all_hidden = self.encodon.forward_packed(packed, bool(output_hidden_states))
        targets = None if labels is None else packed.pack_like(labels)
        logits, loss = head_logits_and_loss(
            self.lm_head, hidden, targets, packed, labeled_logits_only, labeled_token_index
        )
        return MaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


def sequence_means(hidden: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[sequences, hidden]: the mean of each packed sequence's tokens (alignment padding left out), in float32."""
    lengths = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    if packed.num_real_tokens is not None:  # the last segment is the FP8 alignment padding
        lengths, hidden = lengths[:-1], hidden[: packed.num_real_tokens]
    sequence_of_token = torch.repeat_interleave(
        torch.arange(len(lengths), device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    sums = hidden.new_zeros(len(lengths), hidden.shape[-1], dtype=torch.float32)
    sums.index_add_(0, sequence_of_token, hidden.float())
    return sums / lengths.clamp(min=1).unsqueeze(-1)  # an empty BSHD row (all padding) pools to zeros


class NVEncodonClassificationHead(nn.Module):
    """Pooled sequence -> dropout -> dense -> GELU -> dense to ``num_labels``."""

    def __init__(self, config: NVEncodonConfig):
        super().__init__()
        dropout = config.classifier_dropout
        self.dropout = config.hidden_dropout_prob if dropout is None else dropout
        self.dense = tag_magneto_role(nn.Linear(config.hidden_size, config.hidden_size), "linear")
        self.out_proj = tag_magneto_role(nn.Linear(config.hidden_size, config.num_labels), "linear")

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = F.dropout(pooled, self.dropout, self.training)
        return self.out_proj(apply_activation(self.dense(pooled), "gelu"))


class NVEncodonForSequenceClassification(NVEncodonPreTrainedModel):
    """A sequence-level head on the encoder, with Hugging Face's semantics: ``num_labels`` outputs per sequence,
    ``problem_type`` regression (MSE), single_label_classification (cross-entropy) or multi_label_classification
    (BCE with logits); unset, it follows from ``num_labels`` and the labels' dtype as in transformers. The head reads
    the mean of the last hidden state over each sequence's real tokens (<CLS> and <SEP> included, padding not).
    Logits are [sequences, num_labels] for BSHD (one row per batch row) and THD (one per packed sequence) alike."""

    def __init__(self, config: NVEncodonConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encodon = NVEncodonModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.classifier = NVEncodonClassificationHead(config)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.encodon.backend

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        problem_type = self.config.problem_type
        if problem_type is None:
            if self.num_labels == 1:
                problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
        logits = logits.float()
        if problem_type == "regression":
            return F.mse_loss(logits.reshape(labels.shape[0], -1), labels.float().reshape(labels.shape[0], -1))
        if problem_type == "single_label_classification":
            return F.cross_entropy(logits, labels.reshape(-1).long())
        return F.binary_cross_entropy_with_logits(logits, labels.float().reshape(logits.shape))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        packed = self.encodon.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        hidden, all_hidden = self.encodon.forward_packed(packed, bool(output_hidden_states))
        pooled = sequence_means(hidden, packed).to(hidden.dtype)
        logits = self.classifier(pooled)
        if labels is not None and labels.shape[0] != logits.shape[0]:
            raise ValueError(
                f"labels has {labels.shape[0]} rows for {logits.shape[0]} sequences: give one per sequence"
            )
        return SequenceClassifierOutput(
            loss=None if labels is None else self._loss(logits, labels),
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


__all__ = [
    "AUTO_MAP",
    "EncodonLayer",
    "NVEncodonConfig",
    "NVEncodonForMaskedLM",
    "NVEncodonForSequenceClassification",
    "NVEncodonModel",
    "NVEncodonPreTrainedModel",
]
