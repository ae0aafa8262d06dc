"""The final model as a Hugging Face directory: ``AutoModelForMaskedLM.from_pretrained(dir, trust_remote_code=True)``
loads it on any machine, with or without TransformerEngine (hf_export.py: the modeling files beside the weights, no
FP8 layers, ``backend: auto``). The stock EsmForMaskedLM baseline is saved with its own ``save_pretrained``.

The directory appears only once complete; an earlier export there is replaced only after the new one is whole.
"""

import logging
from pathlib import Path

import torch
from hf_export import write_hf_directory
from transformers import EsmForMaskedLM, PreTrainedTokenizerBase, Trainer


logger = logging.getLogger(__name__)


def export_final_model(
    trainer: Trainer, model: torch.nn.Module, output_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> Path | None:
    """Gather the full weights (all processes take part under FSDP2) and write them on the main process."""
    full_state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not trainer.args.should_save:
        return None
    bare = trainer.accelerator.unwrap_model(model)
    if isinstance(bare, EsmForMaskedLM):  # the stock baseline (under FSDP2 an FSDPEsmForMaskedLM subclass)
        bare.save_pretrained(output_dir, state_dict=full_state_dict)
        tokenizer.save_pretrained(output_dir)
        logger.info("Exported the stock %s to %s", type(bare).__name__, output_dir)
        return output_dir
    return write_hf_directory(bare, output_dir, state_dict=full_state_dict, tokenizer=tokenizer)
