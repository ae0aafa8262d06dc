"""A small reference implementation of the published Encodon architecture, for the tests (float32, CPU).

Written from the architecture's description (CodonFM's EnCodon: codon embedding + LayerNorm; layers with four
LayerNorms, MAGNETO's Sub-LN; rotary attention with separate query/key/value projections; an untied MLM head), not
from any implementation in this package. Its ``state_dict`` has the published ``EnCodon`` keys (``embeddings.post_ln``,
``layers.{i}.attention.query``, ``layers.{i}.attention.rotary_emb.inv_freq``, ``cls.3``, ...; a Lightning checkpoint
adds ``model.`` in front), so it plays the "stock model" of the model contract, and ``magneto_init`` draws the
published init by module name.

Everything is computed the slow, explicit way (einsum attention with an additive padding bias, rotate_half rotary from
the stored inv_freq, no fused kernels, no SDPA, no packing), so that it shares no code path with the model under test.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput


class EncodonReferenceConfig(PreTrainedConfig):
    """EncodonPL's architecture arguments and defaults (what a checkpoint's hyper_parameters hold)."""

    model_type = "encodon"

    vocab_size: int = 69
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 3
    rotary_theta: float = 1e4
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False


@dataclass
class ReferenceOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None  # the last layer's output (what the head reads)


ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}  # nn.GELU is the exact (erf) form


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float):
        super().__init__()
        # Persistent, as published: checkpoints store it.
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.einsum("i,j->ij", torch.arange(seq_len).type_as(self.inv_freq), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[None, :, None, :]  # [1, seq, 1, head_dim]
        return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Q, K, V projections and rotary attention; the output projection lives in the layer (post_attn_dense)."""

    def __init__(self, config: EncodonReferenceConfig):
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.dropout = config.attention_probs_dropout_prob
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.rotary_emb = RotaryEmbedding(hidden // self.heads, config.rotary_theta)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = self.query(x).view(shape), self.key(x).view(shape), self.value(x).view(shape)
        cos, sin = self.rotary_emb(seq)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hidden // self.heads) + key_bias
        weights = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        return torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, hidden)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncodonReferenceConfig):
        super().__init__()
        hidden, ffn, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.pre_attn_layer_norm = nn.LayerNorm(hidden, eps=eps)
        self.attention = Attention(config)
        self.post_attn_layer_norm = nn.LayerNorm(hidden, eps=eps)
        self.post_attn_dense = nn.Linear(hidden, hidden)
        self.pre_ffn_layer_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate_dense = nn.Linear(hidden, ffn)
        self.activation = ACTIVATIONS[config.hidden_act]()
        self.post_ffn_layer_norm = nn.LayerNorm(ffn, eps=eps)
        self.output_dense = nn.Linear(ffn, hidden)
        self.dropout = config.hidden_dropout_prob

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        attention = self.post_attn_dense(
            self.post_attn_layer_norm(self.attention(self.pre_attn_layer_norm(x), key_bias))
        )
        x = x + F.dropout(attention, self.dropout, self.training)
        ffn = self.activation(self.intermediate_dense(self.pre_ffn_layer_norm(x)))
        return x + F.dropout(self.output_dense(self.post_ffn_layer_norm(ffn)), self.dropout, self.training)


class CodonEmbedding(nn.Module):
    def __init__(self, config: EncodonReferenceConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.post_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.post_ln(self.word_embeddings(input_ids)), self.dropout, self.training)


class EncodonReference(PreTrainedModel):
    config_class = EncodonReferenceConfig
    config: EncodonReferenceConfig

    def __init__(self, config: EncodonReferenceConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.embeddings = CodonEmbedding(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.cls = nn.Sequential(
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.LayerNorm(hidden, eps=config.layer_norm_eps),
            nn.Linear(hidden, config.vocab_size),
        )
        self.post_init()
        self.magneto_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # the published init is by module name, for the whole model at once: magneto_init

    @torch.no_grad()
    def magneto_init(self) -> None:
        """The published init: Xavier-normal linears with the scaled gain, except query and key (gain 1)."""
        gain = self.config.initializer_range * math.sqrt(math.log(2 * self.config.num_hidden_layers))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_query_or_key = name.endswith(("attention.query", "attention.key"))
                nn.init.xavier_normal_(module.weight, gain=1.0 if is_query_or_key else gain)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
                module.weight[self.config.pad_token_id].zero_()
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls[3]

    def forward(self, input_ids, attention_mask=None, labels=None, **_) -> ReferenceOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # Additive bias on the attention logits: padded keys get the dtype's minimum, as published.
        key_bias = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, key_bias)
        logits = self.cls(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return ReferenceOutput(loss=loss, logits=logits, last_hidden_state=x)
