"""Helpers for the AMPLIFY model tests: tiny shapes, the reference model with random weights, AMPLIFY-style padded
batches (the model contract packs them into THD), and the contract's conversion wrappers around the reference."""

import json
from pathlib import Path

import torch
from amplify_reference import AmplifyReference, AmplifyReferenceConfig

from amplify_te.convert import convert_amplify_hf_to_te, convert_amplify_te_to_hf
from amplify_te.modeling_amplify_te import NVAmplifyForMaskedLM


COMPONENT_DIR = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = COMPONENT_DIR / "model_configs"
TOKENIZER_DIR = COMPONENT_DIR / "amplify_te" / "tokenizer"

TINY_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
SHAPE_KEYS = tuple(TINY_SHAPE)
RESIDUES = range(6, 26)  # the 20 standard residues in the published vocabulary
MASK, BOS, EOS, PAD = 2, 3, 4, 0


def shape_of(config_name: str) -> dict:
    values = json.loads((MODEL_CONFIGS / config_name / "config.json").read_text())
    return {key: values[key] for key in SHAPE_KEYS}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every weight, bias and norm scale a random value, so that a wrong mapping cannot hide behind 0s and 1s."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        else:
            std = 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1
            param.copy_(std * torch.randn(param.shape, generator=generator))
    return model


def reference_model(shape: dict = TINY_SHAPE, seed: int = 0, **config) -> AmplifyReference:
    torch.manual_seed(seed)
    return randomize_(AmplifyReference(AmplifyReferenceConfig(**shape, **config)), seed).eval()


def reference_to_nv(model: AmplifyReference, **config_overrides) -> NVAmplifyForMaskedLM:
    """The contract's hf_to_nv: what a user does with a published checkpoint (its state dict and config.json)."""
    return convert_amplify_hf_to_te(model.state_dict(), model.config.to_dict(), **config_overrides)


def nv_to_reference(model: NVAmplifyForMaskedLM) -> AmplifyReference:
    """The contract's nv_to_hf: the published layout, loaded (strictly) into the reference model."""
    state_dict, config = convert_amplify_te_to_hf(model)
    config = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    reference = AmplifyReference(AmplifyReferenceConfig(**config))
    reference.load_state_dict(state_dict, strict=True)
    return reference.to(dtype=next(model.parameters()).dtype)


def make_batch(lengths: list[int], seed: int = 0, mask_fraction: float = 0.15, padding_side: str = "right") -> dict:
    """Right-padded AMPLIFY batch: <bos> residues <eos>, some residues replaced by <mask>, labels on those."""
    assert padding_side == "right", "AMPLIFY batches are padded on the right"
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.full((len(lengths), seq_len), PAD)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, length in enumerate(lengths):
        residues = torch.randint(RESIDUES.start, RESIDUES.stop, (length - 2,), generator=generator)
        masked = torch.rand(length - 2, generator=generator) < mask_fraction
        masked[0] = True  # every sequence has at least one labelled token
        labels[row, 1 : length - 1] = torch.where(masked, residues, -100)
        body = torch.where(masked, MASK, residues)
        input_ids[row, :length] = torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
