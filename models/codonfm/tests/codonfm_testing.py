"""Helpers for the Encodon model tests: tiny shapes, the reference model with random weights, codon batches padded on
the right (the model contract packs them into THD), and the contract's conversion wrappers around the reference."""

import json
from pathlib import Path

import torch
from encodon_reference import EncodonReference, EncodonReferenceConfig

from codonfm_te.convert import PUBLISHED_HPARAMS, convert_encodon_checkpoint_to_te, convert_encodon_te_to_checkpoint
from codonfm_te.modeling_codonfm_te import NVEncodonForMaskedLM
from codonfm_te.sequences import CLS_ID, FIRST_CODON_ID, MASK_ID, PAD_ID, SEP_ID, VOCAB_SIZE


COMPONENT_DIR = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = COMPONENT_DIR / "model_configs"
TOKENIZER_DIR = COMPONENT_DIR / "codonfm_te" / "tokenizer"

TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
SHAPE_KEYS = tuple(TINY_SHAPE)
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # so outputs can be compared


def shape_of(config_name: str) -> dict:
    values = json.loads((MODEL_CONFIGS / config_name / "config.json").read_text())
    return {key: values[key] for key in SHAPE_KEYS}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every weight, bias and LayerNorm a random value, so that a wrong mapping cannot hide behind 0s and 1s."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "ln" in name or "layer_norm" in name or name.startswith("cls.2."):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        else:
            std = 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model


def reference_model(shape: dict = TINY_SHAPE, seed: int = 0, **config) -> EncodonReference:
    torch.manual_seed(seed)
    reference_config = EncodonReferenceConfig(**{**shape, **NO_DROPOUT, **config})
    return randomize_(EncodonReference(reference_config), seed).eval()


def hyper_parameters(model: EncodonReference) -> dict:
    """What a Lightning checkpoint of this model would hold: EncodonPL's init arguments, plus the training settings
    the conversion must ignore."""
    values = {key: getattr(model.config, key) for key in PUBLISHED_HPARAMS}
    return {**values, "optimizer": None, "scheduler": None, "ignore_index": -100, "finetune_strategy": "full"}


def reference_to_nv(model: EncodonReference, **config_overrides) -> NVEncodonForMaskedLM:
    """The contract's hf_to_nv: what a user does with a published checkpoint (its state dict and hyper_parameters)."""
    return convert_encodon_checkpoint_to_te(model.state_dict(), hyper_parameters(model), **config_overrides)


def reference_from_checkpoint(state_dict: dict, hparams: dict) -> EncodonReference:
    """The reference holding a published-layout checkpoint, loaded strictly (as the published code loads it)."""
    reference = EncodonReference(EncodonReferenceConfig(**{k: hparams[k] for k in PUBLISHED_HPARAMS}))
    reference.load_state_dict({k.removeprefix("model."): v for k, v in state_dict.items()}, strict=True)
    return reference


def nv_to_reference(model: NVEncodonForMaskedLM) -> EncodonReference:
    """The contract's nv_to_hf: the published layout, loaded (strictly) into the reference model."""
    reference = reference_from_checkpoint(*convert_encodon_te_to_checkpoint(model))
    return reference.to(dtype=next(model.parameters()).dtype)


def make_batch(lengths: list[int], seed: int = 0, mask_fraction: float = 0.15, padding_side: str = "right") -> dict:
    """Right-padded codon batch: <CLS> codons <SEP> (lengths count all three), some codons replaced by <MASK>, labels
    on those."""
    assert padding_side == "right", "Encodon batches are padded on the right (as published)"
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.full((len(lengths), seq_len), PAD_ID)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, length in enumerate(lengths):
        codons = torch.randint(FIRST_CODON_ID, VOCAB_SIZE, (length - 2,), generator=generator)
        masked = torch.rand(length - 2, generator=generator) < mask_fraction
        masked[0] = True  # every sequence has at least one labelled token
        labels[row, 1 : length - 1] = torch.where(masked, codons, -100)
        body = torch.where(masked, MASK_ID, codons)
        input_ids[row, :length] = torch.cat([torch.tensor([CLS_ID]), body, torch.tensor([SEP_ID])])
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
