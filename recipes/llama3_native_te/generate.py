# Copied from common/generate.py — edit the source, then run ci/check_copies.py --fix
"""Generate DNA from an exported checkpoint (``<output_dir>/final_model``), the way any user of the export would.

    python generate.py outputs/L0_sanity/final_model --prompt ACGTTGCA --max-new-tokens 200
    python generate.py outputs/L0_sanity/final_model --prompt ACGT --num-samples 4 --temperature 0.8 --top-k 4

Only ``transformers`` is needed: the export holds its own modeling code (``trust_remote_code=True``), its tokenizer
and a config that picks TransformerEngine on a CUDA machine and pure PyTorch elsewhere (``--backend`` overrides).
"""

import argparse

import torch
from perf_logger import quiet_progress_bars_off_a_terminal
from recipe_paths import model_directory, tokenizer_source
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from user_errors import ConfigError, run


def load(model_dir: str, backend: str = "auto", device: str | None = None):
    """The exported model (eval mode, on ``device``) and its tokenizer."""
    # An export with a file missing fails here, by name (without config.json Transformers would build a default model).
    model_dir = str(model_directory(model_dir, key="model_dir", weights=True, remote_code=True))
    tokenizer_source(model_dir, key="model_dir")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True, backend=backend)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, trust_remote_code=True, dtype=dtype)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 100,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Continuations of ``prompt`` (greedy when ``temperature`` is 0), prompt included, special tokens removed."""
    if not prompt or any(ch.isspace() for ch in prompt):
        raise ConfigError("the prompt must be a non-empty run of bases without whitespace, e.g. --prompt ACGT")
    torch.manual_seed(seed)
    batch = tokenizer([prompt] * num_samples, return_tensors="pt").to(model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {}
    sampling.setdefault("do_sample", False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="an exported checkpoint directory (final_model)")
    parser.add_argument("--prompt", default="ACGT", help="bases to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy decoding")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["auto", "te", "torch"], default="auto")
    args = parser.parse_args()
    quiet_progress_bars_off_a_terminal()  # piped to a file: no carriage-return bar while the weights load
    model, tokenizer = load(args.model_dir, args.backend)
    for text in generate(
        model, tokenizer, args.prompt, args.max_new_tokens, args.num_samples, args.temperature, args.top_k, args.seed
    ):
        print(text.replace(" ", ""))


if __name__ == "__main__":
    run(main)  # a user error (a missing export file, a bad prompt) ends in one line; HYDRA_FULL_ERROR=1: traceback
