"""A small reference implementation of the published AMPLIFY architecture, for the tests (float32, CPU).

Written from the architecture's description (Fournier et al., 2024, and the published checkpoints' config.json and
weight names), not from any implementation in this package: pre-norm encoder blocks with RMSNorm, separate bias-free
``q``/``k``/``v``/``wo`` projections, rotary embeddings on interleaved channel pairs (2i, 2i+1) computed as complex
multiplication, softmax attention with padded keys masked, a bias-free SwiGLU FFN packed as ``w12`` (gate, value)
and ``w3``, and an untied ``decoder`` with a bias. Its ``state_dict`` and ``save_pretrained`` use the published
layout (``encoder.weight``, ``transformer_encoder.{i}.q.weight``, ..., ``layer_norm_2.weight``, ``decoder.bias``),
so it plays the "stock Hugging Face model" of the model contract.

Everything is computed the slow, explicit way (no fused kernels, no SDPA), so that it shares no code path with the
model under test.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput


class AmplifyReferenceConfig(PreTrainedConfig):
    """The published config.json fields and defaults (the 350M shape)."""

    model_type = "AMPLIFY"

    hidden_size: int = 960
    num_hidden_layers: int = 32
    num_attention_heads: int = 15
    intermediate_size: int = 3840
    dropout_prob: float = 0.0
    embedding_init_range: float = 0.02
    decoder_init_range: float = 0.02
    rms_norm: bool = True
    norm_eps: float = 1e-5
    hidden_act: str = "SwiGLU"
    layer_norm_after_embedding: bool = False
    layer_norm_before_last_layer: bool = True
    vocab_size: int = 27
    ffn_bias: bool = False
    att_bias: bool = False
    pad_token_id: int | None = 0
    unk_token_id: int | None = 1
    mask_token_id: int | None = 2
    bos_token_id: int | None = 3
    eos_token_id: int | None = 4
    other_special_token_ids: list | None = None
    max_length: int = 2048
    tie_word_embeddings: bool = False


@dataclass
class ReferenceOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None  # what the decoder reads (after layer_norm_2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        # 2/3 of the nominal width, rounded up to a multiple of 8 (1712 for 2560, 2560 for 3840).
        width = int(2 * intermediate / 3)
        width = 8 * ((width + 7) // 8)
        self.w12 = nn.Linear(hidden, 2 * width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


def rotate_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``x`` [batch, seq, heads, head_dim] by ``angles`` [seq, head_dim / 2]:
    each pair is the complex number x[2i] + j x[2i+1], multiplied by exp(j angle)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class EncoderBlock(nn.Module):
    def __init__(self, config: AmplifyReferenceConfig):
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.ffn = SwiGLU(hidden, config.intermediate_size)
        self.attention_norm = RMSNorm(hidden, config.norm_eps)
        self.ffn_norm = RMSNorm(hidden, config.norm_eps)

    def attention(self, x: torch.Tensor, angles: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        shape = (batch, seq, self.heads, hidden // self.heads)
        q = rotate_interleaved(self.q(x).view(shape), angles)
        k = rotate_interleaved(self.k(x).view(shape), angles)
        v = self.v(x).view(shape)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (hidden // self.heads) ** 0.5
        weights = torch.softmax(scores + key_bias, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, hidden)
        return self.wo(out)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), angles, key_bias)
        return x + self.ffn(self.ffn_norm(x))


class AmplifyReference(PreTrainedModel):
    config_class = AmplifyReferenceConfig
    config: AmplifyReferenceConfig

    def __init__(self, config: AmplifyReferenceConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.encoder = nn.Embedding(config.vocab_size, hidden, padding_idx=config.pad_token_id)
        if config.layer_norm_after_embedding:
            self.layer_norm_1 = RMSNorm(hidden, config.norm_eps)
        self.transformer_encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_hidden_layers))
        if config.layer_norm_before_last_layer:
            self.layer_norm_2 = RMSNorm(hidden, config.norm_eps)
        self.decoder = nn.Linear(hidden, config.vocab_size)
        head_dim = hidden // config.num_attention_heads
        # Not persistent: the published checkpoints store no rotary table (the base is fixed at 10000).
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False
        )
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.uniform_(module.weight, -self.config.decoder_init_range, self.config.decoder_init_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.uniform_(module.weight, -self.config.embedding_init_range, self.config.embedding_init_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder

    def forward(self, input_ids, attention_mask=None, labels=None, **_) -> ReferenceOutput:
        batch, seq = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # Additive bias on the attention logits: padded keys get -inf, as the published pad_mask does.
        key_bias = torch.zeros(batch, 1, 1, seq, device=input_ids.device).masked_fill(
            attention_mask[:, None, None, :] == 0, float("-inf")
        )
        angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=input_ids.device), self.inv_freq.float())
        x = self.encoder(input_ids)
        if self.config.layer_norm_after_embedding:
            x = self.layer_norm_1(x)
        for block in self.transformer_encoder:
            x = block(x, angles, key_bias)
        if self.config.layer_norm_before_last_layer:
            x = self.layer_norm_2(x)
        logits = self.decoder(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return ReferenceOutput(loss=loss, logits=logits, last_hidden_state=x)
