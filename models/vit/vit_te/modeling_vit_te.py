"""Vision Transformer with TransformerEngine layers, Hugging Face compatible, that also runs without TE.

The architecture is Hugging Face's ``ViTForImageClassification`` (Dosovitskiy et al., 2021): the image is cut into
``patch_size`` squares, each projected to ``hidden_size`` by a strided convolution; a learned class token is put in
front and learned position embeddings are added; pre-LayerNorm encoder layers (GELU MLP); a final LayerNorm; a linear
classifier on the class token. Two backends build it with the same parameter names and state-dict keys:

* ``te``: ``transformer_engine.pytorch.TransformerLayer`` (fused QKV, fused attention, FP8/FP4 recipes);
* ``torch``: the pure-PyTorch twins in ``torch_layers.py``, used on CPUs and wherever TE is missing.

``config.backend`` chooses: ``auto`` (TE when it imports and CUDA is available), ``te`` or ``torch``.

Every image of a batch has the same number of tokens, so the layers run on BSHD ``[batch, tokens, hidden]`` without
an attention mask. Quantized (FP8/FP4) layers need GEMMs whose token count is a multiple of 16: the sequence is then
padded at its end with masked tokens that no real token attends to, and cut off again after the encoder.

Tensor parallelism (TE backend only): pass ``tp_group``, a process group of the ranks that split every layer. Each
rank then holds its share of the heads (the rows of the fused QKV projection and of the first MLP projection, the
columns of the attention output and the second MLP projection); everything else is replicated. TE marks the split
parameters (``tensor_model_parallel``, ``partition_dim``), which is what Megatron-FSDP reads to shard them further and
to checkpoint them as DTensors of the full shape. :func:`tensor_parallel_shard` cuts a full (1-GPU) state dict into a
rank's share, so a tensor-parallel model starts from exactly the weights a single GPU would.

This file is self-contained apart from the modules it imports from beside it (the ``try`` block below), which are
copied with it into a recipe and shipped with it inside an exported checkpoint (``trust_remote_code=True``).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput


try:  # package import (models/vit, exported checkpoints)
    from .configuration_vit_te import QUANTIZED_TOKEN_ALIGNMENT, NVViTConfig, as_pair
    from .layer_autocast import LayerAutocast
    from .meta_init import materialize_meta_model
    from .torch_layers import TransformerLayer as TorchTransformerLayer
    from .torch_layers import is_torch_twin
except ImportError:  # flat copy inside a recipe folder
    from configuration_vit_te import QUANTIZED_TOKEN_ALIGNMENT, NVViTConfig, as_pair
    from layer_autocast import LayerAutocast
    from meta_init import materialize_meta_model
    from torch_layers import TransformerLayer as TorchTransformerLayer
    from torch_layers import is_torch_twin

try:
    import transformer_engine.pytorch as te

    _TE_IMPORT_ERROR = None
except Exception as error:  # ImportError, or a broken CUDA install raising at import
    te = None
    _TE_IMPORT_ERROR = error


AUTO_MAP = {
    "AutoConfig": "configuration_vit_te.NVViTConfig",
    "AutoModel": "modeling_vit_te.NVViTModel",
    "AutoModelForImageClassification": "modeling_vit_te.NVViTForImageClassification",
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


class NVViTPatchEmbeddings(nn.Module):
    """Non-overlapping ``patch_size`` squares -> ``hidden_size`` vectors, row by row ([batch, patches, hidden])."""

    def __init__(self, config: NVViTConfig):
        super().__init__()
        self.image_size = as_pair(config.image_size)
        self.patch_size = config.patch_size
        self.num_channels = config.num_channels
        self.num_patches = (self.image_size[0] // self.patch_size) * (self.image_size[1] // self.patch_size)
        self.projection = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class NVViTEmbeddings(nn.Module):
    """Patch embeddings with the class token in front, plus learned position embeddings."""

    def __init__(self, config: NVViTConfig):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.patch_embeddings = NVViTPatchEmbeddings(config)
        self.position_embeddings = nn.Parameter(
            torch.zeros(1, self.patch_embeddings.num_patches + 1, config.hidden_size)
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def interpolated_position_embeddings(self, height: int, width: int) -> torch.Tensor:
        """Position embeddings for another image size: the patch grid's embeddings resized bicubically (as Hugging
        Face does, for fine-tuning at a higher resolution); the class token's embedding is kept."""
        class_position, patch_positions = self.position_embeddings[:, :1], self.position_embeddings[:, 1:]
        grid = int(math.sqrt(patch_positions.shape[1]))
        new_height, new_width = height // self.patch_embeddings.patch_size, width // self.patch_embeddings.patch_size
        if (new_height, new_width) == (grid, grid):
            return self.position_embeddings
        hidden = patch_positions.shape[-1]
        patch_positions = patch_positions.reshape(1, grid, grid, hidden).permute(0, 3, 1, 2)
        patch_positions = F.interpolate(
            patch_positions.float(), size=(new_height, new_width), mode="bicubic", align_corners=False
        ).to(patch_positions.dtype)
        patch_positions = patch_positions.permute(0, 2, 3, 1).reshape(1, -1, hidden)
        return torch.cat((class_position, patch_positions), dim=1)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        batch, channels, height, width = pixel_values.shape
        patches = self.patch_embeddings
        if channels != patches.num_channels:
            raise ValueError(f"pixel_values has {channels} channels; the model expects {patches.num_channels}")
        if interpolate_pos_encoding:
            if height % patches.patch_size or width % patches.patch_size:
                raise ValueError(f"image size {height}x{width} is not a multiple of patch_size {patches.patch_size}")
            positions = self.interpolated_position_embeddings(height, width)
        elif (height, width) != patches.image_size:
            raise ValueError(
                f"image size {height}x{width} does not match the model's {patches.image_size[0]}x"
                f"{patches.image_size[1]}; resize the images, or pass interpolate_pos_encoding=True"
            )
        else:
            positions = self.position_embeddings
        embeddings = patches(pixel_values.to(patches.projection.weight.dtype))
        embeddings = torch.cat((self.cls_token.expand(batch, -1, -1), embeddings), dim=1) + positions
        return self.dropout(embeddings)


def _tensor_parallel_kwargs(config: NVViTConfig, backend: str, tp_group) -> dict:
    """TE's arguments that split each layer over ``tp_group`` (no sequence parallelism: every rank sees every token);
    nothing for ``tp_group=None`` or a group of one."""
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    if tp_size == 1:
        return {}
    if backend != "te":
        raise ValueError(f"tensor parallelism (a tp_group of {tp_size} ranks) needs the TransformerEngine backend")
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(config, name) % tp_size:
            raise ValueError(f"{name}={getattr(config, name)} is not divisible by the {tp_size} tensor-parallel ranks")
    return {"set_parallel_mode": True, "tp_group": tp_group, "tp_size": tp_size, "sequence_parallel": False}


@torch.no_grad()
def trunc_normal_in_float32_(tensor: torch.Tensor, std: float) -> None:
    """``nn.init.trunc_normal_(tensor, std=std)`` drawn in float32 and rounded into ``tensor``'s dtype.

    A bf16 model built on the meta device (FSDP2 with ``fp32_master_weights: false``) is initialised in bf16. torch's
    inverse-CDF sampler (torch 2.11) draws uniform numbers in the tensor's dtype, where bf16 rounds some of them to
    ±1, and erfinv(±1) is infinite: about 0.2% of the weights came out as ±2 (100 standard deviations at 0.02), and
    ViT trained on such weights reached 72% where it reaches 98%. Drawing in float32 gives every dtype the same
    weights, rounded.
    """
    if tensor.dtype == torch.float32:
        nn.init.trunc_normal_(tensor, mean=0.0, std=std)
        return
    draw = torch.empty_like(tensor, dtype=torch.float32)
    nn.init.trunc_normal_(draw, mean=0.0, std=std)
    tensor.copy_(draw)


class NVViTEncoder(nn.Module):
    def __init__(self, config: NVViTConfig, backend: str, tp_group=None):
        super().__init__()
        layer_class = te.TransformerLayer if backend == "te" else TorchTransformerLayer
        tensor_parallel = _tensor_parallel_kwargs(config, backend, tp_group)
        std = config.initializer_range

        def init_method(weight: torch.Tensor) -> None:
            trunc_normal_in_float32_(weight, std)

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
                self_attn_mask_type="no_mask",
                layer_type="encoder",
                normalization="LayerNorm",
                activation="gelu",
                bias=True,
                fuse_qkv_params=True,
                qkv_weight_interleaved=True,
                attn_input_format="bshd",
                params_dtype=config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32,
                **device_kwargs,
                **tensor_parallel,
            )
            for index in range(config.num_hidden_layers)
        )


def tensor_parallel_shard(
    model: nn.Module, full_state_dict: dict[str, torch.Tensor], tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """This rank's share of ``full_state_dict`` (a 1-GPU model's weights) for the tensor-parallel ``model``: the
    ``tp_rank``-th of ``tp_size`` equal chunks along ``partition_dim`` of every parameter TE split, the whole tensor
    for every other one. The fused QKV projection keeps its weights per head (``qkv_weight_interleaved``), so a chunk
    of its rows is whole heads, as TE's split expects."""
    params, shard = dict(model.named_parameters()), {}
    for name, local in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        full, param = full_state_dict[name], params.get(name)
        if getattr(param, "tensor_model_parallel", False):
            full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        if full.shape != local.shape:
            raise ValueError(f"{name}: a {tuple(full.shape)} share for a {tuple(local.shape)} tensor-parallel weight")
        shard[name] = full
    return shard


def _is_backend_layer(module: nn.Module) -> bool:
    """A TE or torch_layers module that owns parameters and knows how to initialise them."""
    origin = type(module).__module__
    return (
        hasattr(module, "reset_parameters")
        and (origin.startswith("transformer_engine") or is_torch_twin(module))
        and any(True for _ in module.parameters(recurse=False))
    )


class NVViTPreTrainedModel(PreTrainedModel):
    config_class = NVViTConfig
    config: NVViTConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    _no_split_modules = ["TransformerLayer", "NVViTEmbeddings"]
    # TE keeps FP8 scaling state in `_extra_state`; it is runtime bookkeeping, not part of a published model.
    _keys_to_ignore_on_load_missing = [r"_extra_state"]
    _keys_to_ignore_on_load_unexpected = [r"_extra_state"]

    def no_weight_decay(self) -> set[str]:
        """The parameters AdamW leaves undecayed besides biases and LayerNorm weights, by the last part of their name
        (timm's ``VisionTransformer.no_weight_decay()``, DeiT's rule): the class token and the position embeddings."""
        return {"cls_token", "position_embeddings"}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Truncated normal (``initializer_range``) for every weight matrix, the class token and the position
        embeddings, as the published ViT; zero biases; LayerNorms at identity."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | nn.Conv2d):
            trunc_normal_in_float32_(module.weight, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, NVViTEmbeddings):
            trunc_normal_in_float32_(module.cls_token, std)
            trunc_normal_in_float32_(module.position_embeddings, std)
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


class NVViTModel(NVViTPreTrainedModel):
    """The ViT encoder. ``last_hidden_state`` is [batch, 1 + patches, hidden]; ``pooler_output`` the class token's."""

    def __init__(self, config: NVViTConfig, fp8_recipe=None, fp4_recipe=None, tp_group=None):
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = NVViTEmbeddings(config)
        self.encoder = NVViTEncoder(config, self.backend, tp_group)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layer_precision = list(config.layer_precision or [None] * config.num_hidden_layers)
        self._recipes = {"fp8": fp8_recipe, "fp4": fp4_recipe}
        for precision in set(self.layer_precision) - {None}:
            if self._recipes[precision] is None:
                raise ValueError(f"config.layer_precision asks for {precision} but no {precision}_recipe was passed")
            if self.backend != "te":
                raise ValueError(f"{precision} layers need the TransformerEngine backend (this model uses 'torch')")
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embeddings

    def _layer_autocast(self) -> LayerAutocast:
        """TE autocast regions for the layer loop: one per run of layers with the same ``layer_precision``
        (layer_autocast.py)."""
        return LayerAutocast(self.layer_precision, self._recipes, te.autocast if self.backend == "te" else None)

    def _pad_for_quantized_gemms(self, hidden: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Pad the sequence to a multiple of 16 tokens when any layer is quantized; the padding keys are masked."""
        tokens = hidden.shape[1]
        padded = QUANTIZED_TOKEN_ALIGNMENT * math.ceil(tokens / QUANTIZED_TOKEN_ALIGNMENT)
        if all(p is None for p in self.layer_precision) or padded == tokens:
            return hidden, {}
        hidden = F.pad(hidden, (0, 0, 0, padded - tokens))
        # TE's padding mask: True where a key must be ignored, [batch, 1, 1, keys].
        ignored = torch.arange(padded, device=hidden.device) >= tokens
        mask = ignored.view(1, 1, 1, padded).expand(hidden.shape[0], 1, 1, padded)
        return hidden, {"attention_mask": mask, "self_attn_mask_type": "padding"}

    def forward(
        self,
        pixel_values: torch.Tensor,
        interpolate_pos_encoding: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        hidden = self.embeddings(pixel_values, bool(interpolate_pos_encoding))
        tokens = hidden.shape[1]
        hidden, mask_kwargs = self._pad_for_quantized_gemms(hidden)
        all_hidden = []  # as Hugging Face: the embeddings, then each layer's output (the last one before the norm)
        with self._layer_autocast() as regions:
            for index, layer in enumerate(self.encoder.layers):
                if output_hidden_states:
                    all_hidden.append(hidden[:, :tokens])
                regions.enter_layer(index)
                hidden = layer(hidden, **mask_kwargs)
        if output_hidden_states:
            all_hidden.append(hidden[:, :tokens])
        hidden = self.layernorm(hidden[:, :tokens])
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden,
            pooler_output=hidden[:, 0],
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
        )


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, config: NVViTConfig) -> torch.Tensor:
    """Hugging Face's rule: regression for one label, cross-entropy for class ids, BCE for multi-hot labels."""
    problem_type = config.problem_type
    if problem_type is None:
        if config.num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    logits = logits.float()
    if problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.float().squeeze(-1))
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.float())


class NVViTForImageClassification(NVViTPreTrainedModel):
    """ViT with a linear classifier on the final class token; the classifier runs in high precision."""

    def __init__(self, config: NVViTConfig, fp8_recipe=None, fp4_recipe=None, tp_group=None):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = NVViTModel(config, fp8_recipe=fp8_recipe, fp4_recipe=fp4_recipe, tp_group=tp_group)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    @property
    def backend(self) -> str:
        return self.vit.backend

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput:
        outputs = self.vit(
            pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, output_hidden_states=output_hidden_states
        )
        logits = self.classifier(outputs.pooler_output)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
