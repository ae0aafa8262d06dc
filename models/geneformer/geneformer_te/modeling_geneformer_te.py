"""Geneformer with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

Geneformer (Theodoris et al. 2023) is BERT trained by masked-gene prediction on single-cell transcriptomes written
as rank-value encodings: each cell is its genes sorted by normalised expression, as token ids. The architecture is
Hugging Face's ``BertForMaskedLM``: word + learned absolute position + token-type embeddings, LayerNorm and dropout;
post-norm encoder layers (LayerNorm after each residual add), a ReLU (or GELU) FFN; the MLM head dense -> activation
-> LayerNorm -> decoder tied to the word embeddings, plus a bias. Two backends build it with the same parameter names
and state-dict keys:

* ``te``: ``transformer_engine.pytorch.TransformerLayer`` with ``output_layernorm=True`` and
  ``apply_residual_connection_post_layernorm=True`` (TE's BERT layer: fused QKV, fused attention, FP8/FP4);
* ``torch``: the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and wherever TE is missing.

``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or ``torch``.

Inputs come as BSHD (``input_ids`` [batch, seq] + ``attention_mask``, padded on the right, as BERT's absolute
positions count from the first column) or THD (packed ``input_ids`` [1, tokens] with ``cu_seq_lens_q/k`` and
``max_length_q/k``). The encoder always runs on packed tokens: BSHD input is unpadded on the way in and re-padded on
the way out, so no compute is spent on padding and no cell attends to another. Position embeddings restart at 0 for
every packed cell.

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput


try:  # package import (models/geneformer, exported checkpoints)
    from .configuration_geneformer_te import NVGeneformerConfig
    from .layer_autocast import LayerAutocast
    from .layer_stack import run_layer_stack
    from .meta_init import materialize_meta_model
    from .packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs
    from .te_attention import split_packed_qkv
    from .torch_layers import TransformerLayer as TorchTransformerLayer
    from .torch_layers import is_torch_twin
except ImportError:  # flat copy inside a recipe folder
    from configuration_geneformer_te import NVGeneformerConfig
    from layer_autocast import LayerAutocast
    from layer_stack import run_layer_stack
    from meta_init import materialize_meta_model
    from packing import FP8_TOKEN_ALIGNMENT, PackedBatch, head_logits_and_loss, pack_inputs
    from te_attention import split_packed_qkv
    from torch_layers import TransformerLayer as TorchTransformerLayer
    from torch_layers import is_torch_twin

try:
    import transformer_engine.pytorch as te

    _TE_IMPORT_ERROR = None
except Exception as error:  # ImportError, or a broken CUDA install raising at import
    te = None
    _TE_IMPORT_ERROR = error


AUTO_MAP = {
    "AutoConfig": "configuration_geneformer_te.NVGeneformerConfig",
    "AutoModel": "modeling_geneformer_te.NVGeneformerModel",
    "AutoModelForMaskedLM": "modeling_geneformer_te.NVGeneformerForMaskedLM",
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


def _activation(x: torch.Tensor, name: str) -> torch.Tensor:
    return F.relu(x) if name == "relu" else F.gelu(x)  # exact GELU, as BERT's head


class NVGeneformerEmbeddings(nn.Module):
    """Word + absolute position (restarting at every packed cell) + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: NVGeneformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.padded_vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.max_positions = config.max_position_embeddings

    def forward(self, packed: PackedBatch, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if packed.max_seqlen > self.max_positions:
            raise ValueError(
                f"a sequence of {packed.max_seqlen} tokens is longer than max_position_embeddings "
                f"({self.max_positions}): truncate the cells to at most {self.max_positions} genes"
            )
        embeddings = self.word_embeddings(packed.input_ids) + self.position_embeddings(packed.positions())
        if token_type_ids is None:  # every token of type 0, as BERT assumes when none are given
            embeddings = embeddings + self.token_type_embeddings.weight[0]
        else:
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layer_norm(embeddings))


class NVGeneformerEncoder(nn.Module):
    def __init__(self, config: NVGeneformerConfig, backend: str):
        super().__init__()
        self.backend = backend
        layer_class = te.TransformerLayer if backend == "te" else TorchTransformerLayer
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
                kv_channels=config.hidden_size // config.num_attention_heads,
                layernorm_epsilon=config.layer_norm_eps,
                hidden_dropout=config.hidden_dropout_prob,
                attention_dropout=config.attention_probs_dropout_prob,
                init_method=init_method,
                output_layer_init_method=init_method,
                layer_number=index + 1,
                self_attn_mask_type="padding",
                layer_type="encoder",
                normalization="LayerNorm",
                activation=config.hidden_act,
                bias=True,
                # BERT's post-norm layer: LayerNorm after each residual add (see torch_layers.TransformerLayer).
                output_layernorm=True,
                apply_residual_connection_post_layernorm=True,
                fuse_qkv_params=True,
                qkv_weight_interleaved=True,
                attn_input_format="thd",
                params_dtype=config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32,
                **device_kwargs,
            )
            for index in range(config.num_hidden_layers)
        )
        if backend == "te":  # attention's inputs as views of the QKV projection, copy-free backward
            split_packed_qkv(self.layers)


def _is_backend_layer(module: nn.Module) -> bool:
    """A TE or torch_layers module that owns parameters and knows how to initialise them."""
    origin = type(module).__module__
    return (
        hasattr(module, "reset_parameters")
        and (origin.startswith("transformer_engine") or is_torch_twin(module))
        and any(True for _ in module.parameters(recurse=False))
    )


class NVGeneformerPreTrainedModel(PreTrainedModel):
    config_class = NVGeneformerConfig
    config: NVGeneformerConfig
    base_model_prefix = "bert"
    _no_split_modules = ["TransformerLayer"]
    # gradient_checkpointing_enable() recomputes every layer's activations (see config.recompute_layers).
    supports_gradient_checkpointing = True
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """BERT's init: normal(initializer_range) matrices and embeddings, zero biases, unit LayerNorms."""
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding | nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, NVGeneformerLMHead):
            nn.init.zeros_(module.bias)
        elif _is_backend_layer(module):
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


class NVGeneformerModel(NVGeneformerPreTrainedModel):
    """The Geneformer encoder. ``forward`` returns ``last_hidden_state`` in the caller's layout."""

    def __init__(self, config: NVGeneformerConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = NVGeneformerEmbeddings(config)
        self.encoder = NVGeneformerEncoder(config, self.backend)
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

    def forward_packed(
        self, packed: PackedBatch, token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False
    ):
        """Run the encoder on packed tokens: returns ([tokens, hidden], tuple of per-layer inputs or None).

        ``token_type_ids`` are given in the caller's layout (BSHD or THD) and packed like the tokens.
        """
        if token_type_ids is not None:
            types = packed.pack_like(token_type_ids)
            token_type_ids = types.masked_fill(types < 0, 0)  # alignment padding: type 0, never scored
        hidden = self.embeddings(packed, token_type_ids)
        hidden, all_hidden = run_layer_stack(
            self,
            self.encoder.layers,
            hidden,
            self._layer_autocast(),
            defer_residual=False,
            output_hidden_states=output_hidden_states,
            **packed.layer_boundaries(),
        )
        if output_hidden_states:
            all_hidden.append(hidden)
        return hidden, (tuple(all_hidden) if output_hidden_states else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        packed = self.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        hidden, all_hidden = self.forward_packed(packed, token_type_ids, bool(output_hidden_states))
        return BaseModelOutput(
            last_hidden_state=packed.unpack(hidden),
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )


class NVGeneformerLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> decoder tied to the word embeddings (+ bias). Always in high precision."""

    def __init__(self, config: NVGeneformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.activation = config.hidden_act
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(_activation(self.dense(hidden), self.activation))
        # The GEMM runs over the padded vocabulary; the padding columns are cut before anyone sees them.
        return (self.decoder(x) + self.bias)[..., : self.vocab_size]


class NVGeneformerForMaskedLM(NVGeneformerPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: NVGeneformerConfig, fp8_recipe=None, fp4_recipe=None):
        super().__init__(config)
        self.bert = NVGeneformerModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe)
        self.lm_head = NVGeneformerLMHead(config)
        self.post_init()

    @property
    def backend(self) -> str:
        return self.bert.backend

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
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
        """BERT's masked-LM forward. ``labeled_logits_only=True`` (training) runs the LM head only on the tokens
        that have a label (the ~15% masked genes) and returns their logits as [labeled tokens, vocab], in packed
        order; the loss is the same as with every token's logits. At 25k genes the head over all tokens (the GEMM, the
        float32 logits and their softmax) took 17 of 120 ms of a 106M forward+backward on an H100, for rows the loss
        never reads. ``labeled_token_index`` (``packing.labeled_token_index`` of the CPU batch) names those tokens;
        without it the forward finds them on the GPU, with one host sync."""
        packed = self.bert.pack(input_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q)
        hidden, all_hidden = self.bert.forward_packed(packed, token_type_ids, bool(output_hidden_states))
        targets = None if labels is None else packed.pack_like(labels)
        logits, loss = head_logits_and_loss(
            self.lm_head, hidden, targets, packed, labeled_logits_only, labeled_token_index
        )
        return MaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(packed.unpack(h) for h in all_hidden) if all_hidden else None,
        )
