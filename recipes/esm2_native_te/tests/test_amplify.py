"""AMPLIFY in this recipe: the ESM-2 entrypoints train it when ``model_tag`` holds an AMPLIFY model, on CPU here.

The references are the ones the ESM-2 tests use (loss below the residue background entropy, an export that
reproduces the checkpointed weights, lr=0 fine-tuning that leaves the loaded weights exactly as they were) plus the
published checkpoint layout, written by the model package's own converter.
"""

import json

import pytest
import torch
from convert_amplify import convert_amplify_te_to_hf
from dataset import KEPT, SKIP_INVALID, SequencePolicy, create_dataloader
from launch import RECIPE_DIR, assert_user_error, run_script
from model_families import Amplify, Esm2, family_of
from modeling_amplify_te import NVAmplifyConfig, NVAmplifyForMaskedLM
from safetensors.torch import save_file
from test_finetune import NO_LEARNING, assert_export_holds
from test_train import (
    CONVERGE,
    FAST,
    FAST_BATCHING,
    LOSS_THRESHOLD,
    TINY_MODEL,
    VALIDATE,
    assert_converged,
    assert_export_reproduces_checkpoint,
    assert_validation_is_the_exports_held_out_loss,
    read_metrics,
    restart_with_recompute,
    train,
)
from transformers import AutoTokenizer, EsmConfig
from user_errors import ConfigError
from validation_data import held_out_batches


AMPLIFY = "model_tag=model_configs/AMPLIFY_120M"


def amplify_tokenizer():
    return AutoTokenizer.from_pretrained(RECIPE_DIR / "tokenizer_amplify")


def test_model_tag_decides_the_model_family(tmp_path):
    stock_esm, published_amplify, bert = tmp_path / "esm", tmp_path / "amplify", tmp_path / "bert"
    EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(stock_esm)
    published_amplify.mkdir()
    _, config = convert_amplify_te_to_hf(NVAmplifyForMaskedLM(tiny_config()))
    (published_amplify / "config.json").write_text(json.dumps(config))
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert"}')

    cases = {
        RECIPE_DIR / "model_configs" / "esm2_t6_8M_UR50D": (Esm2, False),
        RECIPE_DIR / "model_configs" / "AMPLIFY_120M": (Amplify, False),  # says model_type "esm", like ESM-2
        stock_esm: (Esm2, True),
        published_amplify: (Amplify, True),
    }
    for source, (family, stock) in cases.items():
        found = family_of(str(source))
        assert (type(found), found.stock) == (family, stock), source
    with pytest.raises(ConfigError, match="holds a 'bert' model, not ESM-2"):
        family_of(str(bert))


@pytest.mark.slow  # ~2 minutes of one CPU core; CI's GPU run trains this config (test_amplify_gpu.py), CPU CI a tiny one
def test_the_shipped_l0_sanity_amplify_config_learns_and_exports(tmp_path):
    """The config as a user runs it (150 steps of the 7M-parameter AMPLIFY, about two minutes on one CPU core)."""
    run_script("train_ddp.py", "--config-name", "L0_sanity_amplify", f"output_dir={tmp_path}", timeout=600)
    metrics = read_metrics(tmp_path)
    assert_converged(metrics, steps=150, initial_loss_above=LOSS_THRESHOLD)  # from ln(27) = 3.3 at step 1
    export_dir = tmp_path / "final_model"
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == ["NVAmplifyForMaskedLM"]
    assert len(AutoTokenizer.from_pretrained(export_dir)) == 27  # the AMPLIFY vocabulary went with the export
    assert_export_reproduces_checkpoint(tmp_path, step=150)


# FSDP2 on packed sequences learns inside the stop-and-go test below.
@pytest.mark.parametrize(
    ("script", "input_format"),
    [
        ("train_ddp.py", "bshd"),
        ("train_cp.py", "thd"),  # cp_size=2 (torch backend: all-gathered attention)
    ],
)
def test_every_cpu_entrypoint_trains_amplify(tmp_path, script, input_format):
    """... on two processes, and validates every 40 steps (AMPLIFY's tokenizer), equal to one process scoring the
    export."""
    cp_size = 2 if script == "train_cp.py" else 1
    extra = [f"cp_size={cp_size}"] if cp_size > 1 else []
    metrics = train(
        script, tmp_path, AMPLIFY, *CONVERGE, *VALIDATE, f"dataset.input_format={input_format}", "dataset.num_workers=0",
        *extra, nproc=2,
    )  # fmt: skip
    assert_amplify_learned_and_exported(tmp_path, metrics, input_format, cp_size)


def assert_amplify_learned_and_exported(output_dir, metrics: list[dict], input_format: str, cp_size: int = 1) -> None:
    assert_converged(metrics, steps=80, initial_loss_above=LOSS_THRESHOLD)
    export_dir = output_dir / "final_model"
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == ["NVAmplifyForMaskedLM"]
    assert len(AutoTokenizer.from_pretrained(export_dir)) == 27  # the AMPLIFY vocabulary went with the export
    assert_export_reproduces_checkpoint(output_dir, step=80)
    assert_validation_is_the_exports_held_out_loss(
        output_dir, [40, 80], FAST_BATCHING, input_format, cp_size=cp_size, tokenizer_dir="tokenizer_amplify"
    )


def test_amplify_stop_and_go_matches_uninterrupted_run(tmp_path):
    """FSDP2 shards AMPLIFY's own module tree on packed sequences: 80 steps in one go (saving and validating at step
    40) learn, validate and export as above; a restart from the step-40 checkpoint, recomputing both layers'
    activations in backward, logs the same losses and gradient norms, bit for bit (as test_train.py's stop-and-go)."""
    common = [AMPLIFY, *CONVERGE, *VALIDATE, "logger.log_every=1", "checkpoint.save_every=40"]
    common += ["dataset.input_format=thd", "dataset.num_workers=0"]
    full = train("train_fsdp2.py", tmp_path / "full", *common, nproc=2)
    assert_amplify_learned_and_exported(tmp_path / "full", full, "thd")

    resumed = restart_with_recompute("train_fsdp2.py", tmp_path / "full", 40, tmp_path / "restarted", *common)
    assert [m["step"] for m in resumed] == list(range(41, 81))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[40:]]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full[40:]]


# ------------------------------------------------------------------------------------------- published checkpoints


def tiny_config() -> NVAmplifyConfig:
    return NVAmplifyConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)


@pytest.fixture(scope="module")
def published_checkpoint(tmp_path_factory):
    """A tiny AMPLIFY in the published layout (chandar-lab's keys and config.json), with random weights."""
    torch.manual_seed(5)
    model = NVAmplifyForMaskedLM(tiny_config())
    vocab = model.config.vocab_size
    with torch.no_grad():
        model.decoder.bias.normal_()  # zero at init: make it something a wrong load could not reproduce
        # The published layout has no vocabulary padding; conversion pads with zeros. Zero it here too, so the
        # model's own weights are the reference for every row.
        for padded in (model.amplify.embeddings.weight, model.decoder.weight, model.decoder.bias):
            padded[vocab:] = 0
    state_dict, config = convert_amplify_te_to_hf(model)
    path = tmp_path_factory.mktemp("published") / "AMPLIFY_tiny"
    path.mkdir()
    save_file(state_dict, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    # The weights as the NV model held them before the round trip through the published layout: the reference.
    return path, state_dict, config, model.state_dict()


@pytest.mark.parametrize(("script", "nproc"), [("train_ddp.py", None), ("train_fsdp2.py", 2)])
def test_finetune_from_a_published_checkpoint_keeps_its_weights(tmp_path, published_checkpoint, script, nproc):
    """Converted on load; with lr=0 the export must hold the published weights exactly (FSDP2: loaded per shard)."""
    path, _, _, expected = published_checkpoint
    first = tmp_path / "from_published"
    run_script(
        script, f"output_dir={first}", f"model_tag={path}", "init_from_pretrained=true", *FAST, *NO_LEARNING,
        nproc=nproc,
    )  # fmt: skip
    assert_export_holds(first, expected, "NVAmplifyForMaskedLM")

    # ... and the export is a model_tag in its turn (an NVAmplify directory, not the published layout). Once: reading
    # an export differs from reading the published checkpoint in the family's reader, not in the strategy's sharding.
    if script != "train_ddp.py":
        return
    second = tmp_path / "from_export"
    run_script(
        script, f"output_dir={second}", f"model_tag={first / 'final_model'}", "init_from_pretrained=true", *FAST,
        *NO_LEARNING, nproc=nproc,
    )  # fmt: skip
    assert_export_holds(second, expected, "NVAmplifyForMaskedLM")


def test_published_checkpoint_with_a_missing_weight_names_it(tmp_path, published_checkpoint):
    _, state_dict, config, _ = published_checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(
        {k: v for k, v in state_dict.items() if k != "transformer_encoder.1.ffn.w3.weight"},
        broken / "model.safetensors",
    )
    (broken / "config.json").write_text(json.dumps(config))
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path / 'run'}", f"model_tag={broken}", "init_from_pretrained=true", *FAST,
        *NO_LEARNING, expect_failure=True,
    )  # fmt: skip
    assert_user_error(result, "missing keys ['transformer_encoder.1.ffn.w3.weight']")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------ tokens and data


def test_the_esm2_tokenizer_on_an_amplify_model_fails_clearly(tmp_path):
    """33 ESM-2 tokens would index AMPLIFY's 27-token embedding (padded to 64 rows) and train on without an error."""
    result = run_script(
        "train_ddp.py", f"output_dir={tmp_path}", AMPLIFY, TINY_MODEL, "tokenizer_path=tokenizer", *FAST,
        expect_failure=True,
    )  # fmt: skip
    assert_user_error(
        result, "does not fit the AMPLIFY model", "vocabulary size 33 (model: 27)", "tokenizer_path=auto"
    )


def test_residues_outside_the_amplify_vocabulary_follow_the_policy():
    """AMPLIFY's vocabulary has the 20 amino acids and B but not X, U, Z or O (ESM-2's has them all)."""
    tokenizer = amplify_tokenizer()
    tokens = tokenizer("MKV")["input_ids"]
    assert tokens[0] == tokenizer.convert_tokens_to_ids("<bos>") and tokens[-1] == tokenizer.eos_token_id

    def clean(policy: str):
        sequence_policy = SequencePolicy.from_tokenizer(tokenizer, max_seq_length=64, invalid_residue_policy=policy)
        return sequence_policy.clean("MKXV", crop_seed=(0,), where="row 3")

    with pytest.raises(ConfigError, match=r"row 3: characters \['X'\] are not residues of the tokenizer"):
        clean("error")
    assert clean("skip")[1] == SKIP_INVALID
    text, code, replaced, _ = clean("replace_unk")
    assert (code, replaced) == (KEPT, 1)
    assert tokenizer(text)["input_ids"] == tokenizer.convert_tokens_to_ids(["<bos>", "M", "K", "<unk>", "V", "<eos>"])


@pytest.mark.parametrize("build", ["training", "held_out"])
def test_masking_replaces_residues_only_with_amplify_residues(tmp_path, build):
    """The training and held-out loaders mask AMPLIFY's sequences with its own residues (ids 6..26) as the random
    replacements, never its <eos> (4), '|' (5) or ids past its 27 tokens (ESM-2's range 4..28 gave all three)."""
    tokenizer = amplify_tokenizer()
    data = {"path": str(RECIPE_DIR / "data" / "sanity_proteins.parquet"), "max_seq_length": 128, "num_workers": 0}
    data.update(mlm_probability=0.5, cache_dir=str(tmp_path / "cache"))
    if build == "training":
        loader = iter(create_dataloader(data, tokenizer, dp_rank=0, dp_world_size=1, seed=3))
        batches = [next(loader) for _ in range(10)]
    else:
        batches = list(held_out_batches(data["path"], data, tokenizer, seed=3).read())
    replaced = set()
    for batch in batches:
        labelled = batch["labels"] != -100
        changed = labelled & (batch["input_ids"] != tokenizer.mask_token_id) & (batch["input_ids"] != batch["labels"])
        replaced |= set(batch["input_ids"][changed].tolist())
    assert len(replaced) > 10 and replaced <= set(range(6, 27)), sorted(replaced)


def test_fp8_with_an_ffn_width_fp8_cannot_run_fails_before_training(tmp_path):
    """intermediate_size 1280 gives AMPLIFY a SwiGLU width of 856, not a multiple of 16: TE would assert on the first
    forward. The recipe says so up front, on any machine (the shape check comes before the hardware check)."""
    result = run_script(
        "train_ddp.py", "--config-name", "L0_sanity_amplify", f"output_dir={tmp_path}", "fp8_config.enabled=true",
        "model_config_overrides.intermediate_size=1280", expect_failure=True,
    )  # fmt: skip
    assert_user_error(result, "multiples of 16", "FFN width 856", "intermediate_size 1280")
