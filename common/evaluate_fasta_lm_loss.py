"""Per-sequence negative log-likelihood and perplexity of a DNA language model over a FASTA file, as JSON.

    python scripts/evaluate_fasta_lm_loss.py outputs/<run>/final_model eval.fasta --output eval.json
    python scripts/evaluate_fasta_lm_loss.py outputs/<run>/checkpoints/step_20000 eval.fasta  # a training checkpoint

The checkpoint is either an exported Hugging Face directory (loaded with ``AutoModelForCausalLM`` and
``trust_remote_code``: this recipe's ``final_model/`` or any causal LM with a nucleotide vocabulary) or a complete
training checkpoint of this recipe (``checkpoints/step_<N>``: DCP from FSDP2 or context parallelism, or DDP's
``train_state.pt``; the model config is read from ``../model_config``, which the training scripts write beside their
checkpoints, or from ``--model-config``). A checkpoint still being written (``step_<N>.tmp``, or no ``COMPLETE``
marker) is refused. The same script and FASTA give comparable numbers for two models, which is how a run is compared
with a Megatron baseline (export the baseline to Hugging Face format first).

Scoring rules, those of training: each sequence is ``<bos>`` + bases (``--no-bos`` to leave it out); every base is
predicted from the tokens before it; bases other than A/C/G/T (N, IUPAC codes) are not scored; lowercase
(soft-masked) bases are scored as their uppercase base. The mean NLL of a sequence is over its scored bases.

Sequences longer than ``--window-length`` tokens are scored with sliding windows that end every ``--stride`` tokens:
each window reaches ``--window-length`` tokens back and scores only the tokens not scored by an earlier window. So every
position is scored exactly once, with at least ``window_length - stride`` tokens of context (or all the tokens before
it, near the start). ``--stride`` trades cost (window_length / stride forward passes per window length) for context.
"""

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe's flat modules
from checkpoint import COMPLETE_MARKER
from collator import IGNORE_INDEX, LabelMaker
from dataset import iter_fasta
from recipe_paths import model_directory
from user_errors import ConfigError, UserError


RECIPE_DIR = Path(__file__).resolve().parents[1]


def scoring_windows(length: int, window_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over ``length`` tokens; position 0 has no context."""
    if not 0 < stride <= window_length:
        raise ValueError(f"stride must be in (0, window_length={window_length}], got {stride}")
    windows, scored_until, end = [], 1, min(window_length, length)
    while True:
        windows.append((max(0, end - window_length), end, scored_until))
        if end >= length:
            return windows
        scored_until, end = end, min(end + stride, length)


def load_model(checkpoint: Path, model_config: Path | None, backend: str, device: torch.device):
    """An exported Hugging Face directory, or a complete training checkpoint of this recipe; in eval mode on
    ``device``."""
    if (checkpoint / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        model_directory(str(checkpoint), key="checkpoint", weights=True, remote_code=True)  # an export lacking a file

        kwargs = {"trust_remote_code": True}
        config = AutoConfig.from_pretrained(checkpoint, **kwargs)
        if hasattr(config, "backend") and backend != "auto":
            config.backend = backend
        return AutoModelForCausalLM.from_pretrained(checkpoint, config=config, **kwargs).to(device).eval()
    ddp_state = checkpoint / "train_state.pt"
    if not ((checkpoint / ".metadata").is_file() or ddp_state.is_file()):
        raise FileNotFoundError(
            f"{checkpoint} is neither a Hugging Face directory (config.json) nor a training checkpoint (a DCP "
            f".metadata or DDP's train_state.pt)"
        )
    if not (checkpoint / COMPLETE_MARKER).is_file():
        raise ConfigError(
            f"{checkpoint} has no {COMPLETE_MARKER} marker: it is still being written, or its save was cut short; "
            "evaluate a complete checkpoints/step_<N> or the run's final_model"
        )
    from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM

    config_dir = model_config or checkpoint.parent / "model_config"
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model config at {config_dir}; pass --model-config <dir with config.json>")
    config = NVLlamaConfig.from_pretrained(config_dir, backend=backend, layer_precision=None)
    with torch.device(device):
        model = NVLlamaForCausalLM(config)
    # TE's _extra_state (FP8 scaling history) is runtime state, and differs between backends: weights only.
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if ddp_state.is_file():
        # Memory-mapped: only the model's tensors are read, not the optimizer state beside them.
        saved = torch.load(ddp_state, map_location="cpu", mmap=True, weights_only=True)["model"]
        saved = {k: v for k, v in saved.items() if not k.endswith("_extra_state")}
        if saved.keys() != weights.keys() or any(saved[k].shape != weights[k].shape for k in weights):
            raise ConfigError(
                f"checkpoint {checkpoint} does not match the model of {config_dir}: missing "
                f"{sorted(weights.keys() - saved.keys())}, unexpected {sorted(saved.keys() - weights.keys())}, "
                f"other shapes {sorted(k for k in weights.keys() & saved.keys() if saved[k].shape != weights[k].shape)}"
                "; pass --model-config <the run's checkpoints/model_config>"
            )
        model.load_state_dict(saved, strict=False)  # strict=False: only the _extra_state entries are left out
    else:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:  # in place, into the model's own tensors
                dcp.load({"model": weights}, checkpoint_id=str(checkpoint), no_dist=True)
            except (dcp.api.CheckpointException, RuntimeError, ValueError) as error:  # a key or a shape differs
                raise ConfigError(
                    f"checkpoint {checkpoint} does not match the model of {config_dir} ({error}); pass "
                    "--model-config <the run's checkpoints/model_config>"
                ) from None
    return model.eval()


def tokenize(sequence: str, tokenizer, bos: bool) -> np.ndarray:
    ids = tokenizer(sequence, add_special_tokens=False)["input_ids"]
    return np.array(([tokenizer.bos_token_id] if bos else []) + ids, dtype=np.int64)


@torch.no_grad()
def sequence_nll(model, tokens: np.ndarray, targets: np.ndarray, windows, device, autocast: bool) -> tuple[float, int]:
    """(summed NLL, scored positions) of one sequence, one forward pass per window."""
    total, count = 0.0, 0
    for start, end, first in windows:
        ids = torch.from_numpy(tokens[start:end]).to(device)[None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            # Plain [1, tokens] input_ids: what any Hugging Face causal LM accepts (a Megatron export as well).
            logits = model(input_ids=ids, use_cache=False).logits
        # logits[i] predicts token start + i + 1: positions first..end-1 use rows first-start-1 .. end-start-2.
        log_probs = logits[0, first - start - 1 : end - start - 1].float().log_softmax(-1)
        target = torch.from_numpy(targets[first:end]).to(device)
        scored = target != IGNORE_INDEX
        picked = log_probs[scored].gather(-1, target[scored][:, None])
        total -= float(picked.sum())
        count += int(scored.sum())
    return total, count


def evaluate(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if not Path(args.fasta).is_file():
        raise FileNotFoundError(f"FASTA file {args.fasta} does not exist")
    tokenizer_dir = args.tokenizer or (checkpoint if (checkpoint / "tokenizer_config.json").is_file() else None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or RECIPE_DIR / "tokenizer", trust_remote_code=True)
    model = load_model(checkpoint, Path(args.model_config) if args.model_config else None, args.backend, device)
    labels = LabelMaker(tokenizer, uppercase_labels=True, mask_degenerate_bases=True)
    autocast = device.type == "cuda" and args.precision == "bf16"
    stride = args.stride or args.window_length // 2

    results, nll_total, scored_total = [], 0.0, 0
    for name, sequence in iter_fasta(Path(args.fasta)):
        tokens = tokenize(sequence, tokenizer, not args.no_bos)
        windows = scoring_windows(len(tokens), args.window_length, stride)
        nll, scored = sequence_nll(model, tokens, labels(tokens), windows, device, autocast)
        mean = nll / scored if scored else None
        results.append(
            {
                "id": name.split()[0] if name else "",
                "bases": len(sequence),
                "scored_bases": scored,
                "windows": len(windows),
                "mean_nll": mean,
                "perplexity": math.exp(mean) if mean is not None else None,
            }
        )
        nll_total, scored_total = nll_total + nll, scored_total + scored
    if not results:
        raise ValueError(f"{args.fasta} holds no FASTA records")
    per_sequence = [r["mean_nll"] for r in results if r["mean_nll"] is not None]
    return {
        "checkpoint": str(checkpoint),
        "fasta": str(args.fasta),
        "window_length": args.window_length,
        "stride": stride,
        "bos": not args.no_bos,
        "device": str(device),
        "precision": "bf16" if autocast else "fp32",
        "num_sequences": len(results),
        "mean_of_sequence_nll": sum(per_sequence) / len(per_sequence) if per_sequence else None,
        "token_weighted_nll": nll_total / scored_total if scored_total else None,
        "token_weighted_perplexity": math.exp(nll_total / scored_total) if scored_total else None,
        "sequences": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="Hugging Face export or training checkpoint directory (step_<N>)")
    parser.add_argument("fasta", help="FASTA file (.fa/.fasta/.fna, optionally .gz)")
    parser.add_argument("--output", help="write the JSON here (default: stdout)")
    parser.add_argument("--window-length", type=int, default=8192, help="tokens per forward pass (default 8192)")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window ends (default window/2)")
    parser.add_argument("--no-bos", action="store_true", help="do not prepend <bos> to each sequence")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available) | cpu | cuda[:N]")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="compute on CUDA (CPU: fp32)")
    parser.add_argument("--backend", choices=["auto", "te", "torch"], default="auto", help="layer implementation")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, else the recipe's)")
    parser.add_argument("--model-config", help="directory with config.json for a training checkpoint")
    args = parser.parse_args(argv)
    try:
        report = evaluate(args)
    except (FileNotFoundError, ValueError, UserError) as error:
        print(f"evaluate_fasta_lm_loss: error: {error}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
