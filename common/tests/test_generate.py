"""generate.py on a tiny export: greedy output equals a hand-rolled argmax loop over the full prefix (no cache)."""

import pytest
import torch
from checkpoint import export_final_model, gather_full_state_dict
from generate import generate, load
from launch import run_script
from modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM
from recipe_paths import recipe_path
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = NVLlamaConfig.from_pretrained(recipe_path("model_configs/llama3-tiny-nucleotide"), backend="torch")
    model = NVLlamaForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(recipe_path("tokenizer"))
    out = tmp_path_factory.mktemp("export") / "final_model"
    export_final_model(model, gather_full_state_dict(model, "ddp"), out, tokenizer)
    return out, model.eval(), tokenizer


def test_greedy_generation_matches_argmax_loop(export_dir):
    out, reference, tokenizer = export_dir
    model, loaded_tokenizer = load(str(out), backend="torch", device="cpu")
    text = generate(model, loaded_tokenizer, "ACGTTGCA", max_new_tokens=12)[0].replace(" ", "")

    ids = tokenizer("ACGTTGCA", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(12):
            next_id = reference(ids, use_cache=False).logits[0, -1].argmax()
            if next_id == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    assert text == tokenizer.decode(ids[0], skip_special_tokens=True).replace(" ", "")
    assert text.startswith("ACGTTGCA") and len(text) > len("ACGTTGCA")


def test_sampling_is_seeded_and_rejects_bad_prompts(export_dir):
    model, tokenizer = load(str(export_dir[0]), backend="torch", device="cpu")
    first = generate(model, tokenizer, "ACGT", max_new_tokens=10, num_samples=2, temperature=1.0, seed=3)
    assert first == generate(model, tokenizer, "ACGT", max_new_tokens=10, num_samples=2, temperature=1.0, seed=3)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, tokenizer, "AC GT")


def test_cli(export_dir):
    result = run_script("generate.py", str(export_dir[0]), "--prompt", "GATTACA", "--max-new-tokens", "5")
    assert result.stdout.strip().splitlines()[-1].startswith("GATTACA")
