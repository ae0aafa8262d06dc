"""Meta-device initialisation, backend selection and clear errors for bad configs and input."""

import pytest
import torch
from llama_testing import TINY_GQA_SHAPE, expected_init_std, make_batch, pack

from llama3_te.convert import convert_llama_hf_to_te
from llama3_te.modeling_llama_te import NVLlamaConfig, NVLlamaForCausalLM


def _config(**overrides) -> NVLlamaConfig:
    shape = {**TINY_GQA_SHAPE, "hidden_size": 256, "intermediate_size": 512}
    return NVLlamaConfig(**{**shape, "vocab_size": 256, "backend": "torch", **overrides})


def _weight_statistics(model: NVLlamaForCausalLM) -> dict[str, tuple[float, float]]:
    return {name: (p.float().mean().item(), p.float().std().item()) for name, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_init_matches_direct_init_distribution(tie):
    torch.manual_seed(0)
    direct = NVLlamaForCausalLM(_config(tie_word_embeddings=tie))
    with torch.device("meta"):
        deferred = NVLlamaForCausalLM(_config(tie_word_embeddings=tie))
    assert all(p.is_meta for p in deferred.parameters())
    deferred.init_empty_weights("cpu")
    direct_stats, deferred_stats = _weight_statistics(direct), _weight_statistics(deferred)
    assert direct_stats.keys() == deferred_stats.keys()
    std = direct.config.initializer_range
    for name, (mean, spread) in deferred_stats.items():
        if name.endswith(("layer_norm_weight", "norm.weight")):
            assert (mean, spread) == (1.0, 0.0), name
        else:
            assert abs(mean) < 0.1 * std and abs(spread - std) < 0.1 * std, (name, mean, spread)
            assert abs(spread - direct_stats[name][1]) < 0.1 * std, name
    assert (deferred.lm_head.weight is deferred.model.embed_tokens.weight) == tie
    expected_inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(deferred.model.rotary_emb.inv_freq, expected_inv_freq)


@pytest.mark.parametrize(
    "switches",
    [
        {"embedding_init_std": 1.0},
        {"scale_output_projection_init": True},
        {"embedding_init_std": 1.0, "scale_output_projection_init": True},
    ],
    ids=["spike_no_more_embedding", "scaled_output_projections", "both"],
)
@pytest.mark.parametrize("on_meta_device", [False, True], ids=["direct", "meta"])
def test_init_switches_set_the_documented_std(switches, on_meta_device):
    # 8 layers: scaled output projections start at 0.02 / sqrt(16) = 0.005, far from the unscaled 0.02.
    config = _config(num_hidden_layers=8, **switches)
    torch.manual_seed(0)
    with torch.device("meta" if on_meta_device else "cpu"):
        model = NVLlamaForCausalLM(config)
    if on_meta_device:
        model.init_empty_weights("cpu")
    for name, param in model.named_parameters():
        expected = expected_init_std(name, config)
        if expected is None:
            assert torch.all(param == 1), name
        else:
            assert abs(param.float().std().item() - expected) < 0.05 * expected, (name, param.std().item(), expected)


def test_meta_initialised_model_trains():
    with torch.device("meta"):
        model = NVLlamaForCausalLM(_config())
    model.init_empty_weights("cpu")
    input_ids, attention_mask, labels = make_batch([20, 12])
    loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform predictions at init
    loss.backward()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "tensorrt"}, "backend must be one of"),
        ({"num_key_value_heads": 3}, "divisible by num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act='silu'"),
        ({"attention_bias": True}, "attention_bias and mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type must be one of"),
        ({"layer_precision": ["fp8"]}, "layer_precision has 1 entries for 2 layers"),
        ({"layer_precision": ["fp8", "int4"]}, "int4"),
        ({"padded_vocab_size": 16}, "padded_vocab_size"),
        ({"embedding_init_std": 0.0}, "embedding_init_std must be positive"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_legacy_rope_scaling_argument_is_read():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = _config(rope_scaling={**scaling, "original_max_position_embeddings": 8192}, rope_theta=500000.0)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    reloaded = NVLlamaConfig.from_dict(config.to_dict())
    assert reloaded.rope_parameters == config.rope_parameters


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where TE cannot run")
def test_te_backend_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="backend='te' was requested but cannot run here"):
        NVLlamaForCausalLM(_config(backend="te"))


def test_fp8_layers_on_the_torch_backend_are_refused():
    with pytest.raises(ValueError, match="no fp8_recipe was passed"):
        NVLlamaForCausalLM(_config(layer_precision=["fp8", None]))
    with pytest.raises(ValueError, match="need the TransformerEngine backend"):
        NVLlamaForCausalLM(_config(layer_precision=["fp8", None]), fp8_recipe=object())


@pytest.fixture
def tiny_model(hf_tiny):
    return convert_llama_hf_to_te(hf_tiny, backend="torch").eval()


def test_cu_seq_lens_not_matching_token_count(tiny_model):
    batch = pack(*make_batch([10, 6]))
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 10, 15], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must end at the number of tokens \(16\); it ends at 15"):
        tiny_model(**batch)


def test_mismatched_thd_keys_and_masks(tiny_model):
    batch = pack(*make_batch([10, 6]))
    with pytest.raises(ValueError, match="cu_seq_lens_k == cu_seq_lens_q"):
        tiny_model(**{**batch, "cu_seq_lens_k": torch.tensor([0, 8, 16], dtype=torch.int32)})
    with pytest.raises(ValueError, match="takes no attention_mask"):
        tiny_model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
    with pytest.raises(ValueError, match=r"THD input_ids must be \[1, tokens\]"):
        tiny_model(**{**batch, "input_ids": batch["input_ids"].view(2, 8)})
    input_ids, attention_mask, _ = make_batch([10, 6])
    with pytest.raises(ValueError, match="attention_mask"):
        tiny_model(input_ids, attention_mask=attention_mask[:, :5])
    with pytest.raises(ValueError, match="only 0 and 1"):
        tiny_model(input_ids, attention_mask=attention_mask * 2)


def test_cache_errors_are_named(tiny_model):
    input_ids, attention_mask, labels = make_batch([10, 6])
    with pytest.raises(ValueError, match="labels cannot be combined with a KV cache"):
        tiny_model(input_ids, attention_mask=attention_mask, labels=labels, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask must cover"):
        tiny_model(input_ids, attention_mask=attention_mask[:, :4], use_cache=True)


def test_labels_and_shift_labels_are_exclusive_and_cp_needs_a_group(tiny_model):
    batch = pack(*make_batch([10, 6]))
    with pytest.raises(ValueError, match="not both"):
        tiny_model(**batch, shift_labels=batch["labels"])
    with pytest.raises(ValueError, match="call set_context_parallel_group"):
        tiny_model(**batch, cu_seq_lens_q_padded=batch["cu_seq_lens_q"])
