"""Helpers for the ESM-2 model tests: tiny configs, random weights, ESM-style padded batches (the model contract
packs them into THD)."""

import json
from pathlib import Path

import torch
from transformers import EsmConfig


COMPONENT_DIR = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = COMPONENT_DIR / "model_configs"
TOKENIZER_DIR = COMPONENT_DIR / "esm2_te" / "tokenizer"

TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def hf_esm2_config(**shape) -> EsmConfig:
    """A stock Hugging Face ESM-2 config (rotary, token dropout, no dropout) of the given shape."""
    return EsmConfig(
        vocab_size=33,
        mask_token_id=32,
        pad_token_id=1,
        position_embedding_type="rotary",
        token_dropout=True,
        emb_layer_norm_before=False,
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=1026,
        **shape,
    )


def shape_of(config_name: str) -> dict:
    values = json.loads((MODEL_CONFIGS / config_name / "config.json").read_text())
    return {key: values[key] for key in TINY_SHAPE}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every weight, bias and LayerNorm a random value, so that a wrong mapping cannot hide behind zeros/ones."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "LayerNorm" in name or "layer_norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        else:
            std = 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model


def make_batch(lengths: list[int], seed: int = 0, mask_fraction: float = 0.15):
    """Right-padded ESM-style batch: <cls> residues <eos>, some residues replaced by <mask>, labels on those."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.full((len(lengths), seq_len), 1)  # <pad>
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, length in enumerate(lengths):
        residues = torch.randint(4, 24, (length - 2,), generator=generator)
        masked = torch.rand(length - 2, generator=generator) < mask_fraction
        masked[0] = True  # every sequence has at least one labelled token
        labels[row, 1 : length - 1] = torch.where(masked, residues, -100)
        input_ids[row, :length] = torch.cat([torch.tensor([0]), torch.where(masked, 32, residues), torch.tensor([2])])
        attention_mask[row, :length] = 1
    return input_ids, attention_mask, labels


def model_inputs(input_format: str, lengths=(200, 130, 77, 250, 31), device: str = "cuda") -> dict:
    """``make_batch(lengths)`` as keyword arguments for the models on ``device``: padded (``"bshd"``, with the
    attention mask) or packed (``"thd"``: the real tokens end to end as one row, ``cu_seq_lens_q`` at the sequence
    boundaries)."""
    input_ids, attention_mask, labels = make_batch(list(lengths))
    if input_format == "bshd":
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    else:
        keep = attention_mask.bool()
        sequence_lengths = attention_mask.sum(1)
        batch = {
            "input_ids": input_ids[keep][None],
            "labels": labels[keep][None],
            "cu_seq_lens_q": torch.nn.functional.pad(sequence_lengths.cumsum(0), (1, 0)).int(),
            "max_length_q": int(sequence_lengths.max()),
        }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
