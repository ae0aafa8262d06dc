"""Meta-device initialisation, backend selection and clear errors for bad input."""

import pytest
import torch
from esm_testing import TINY_SHAPE, make_batch, pack

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM


def _config(**overrides) -> NVEsmConfig:
    return NVEsmConfig(**{**TINY_SHAPE, "hidden_size": 256, "intermediate_size": 512, "backend": "torch", **overrides})


def _weight_statistics(model: NVEsmForMaskedLM) -> dict[str, tuple[float, float]]:
    return {name: (p.float().mean().item(), p.float().std().item()) for name, p in model.named_parameters()}


def test_meta_init_matches_direct_init_distribution():
    torch.manual_seed(0)
    direct = NVEsmForMaskedLM(_config())
    with torch.device("meta"):
        deferred = NVEsmForMaskedLM(_config())
    assert all(p.is_meta for p in deferred.parameters())
    deferred.init_empty_weights("cpu")
    direct_stats, deferred_stats = _weight_statistics(direct), _weight_statistics(deferred)
    assert direct_stats.keys() == deferred_stats.keys()
    std = direct.config.initializer_range
    for name, (mean, spread) in deferred_stats.items():
        if name.endswith(("layer_norm_weight", "layer_norm.weight", "emb_layer_norm_after.weight")):
            assert (mean, spread) == (1.0, 0.0), name
        elif name.endswith(("bias", "_bias")):
            assert (mean, spread) == (0.0, 0.0), name
        else:
            assert abs(mean) < 0.1 * std and abs(spread - std) < 0.1 * std, (name, mean, spread)
            assert abs(spread - direct_stats[name][1]) < 0.1 * std, name
    assert deferred.lm_head.decoder.weight is deferred.esm.embeddings.word_embeddings.weight
    expected_inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.allclose(deferred.esm.encoder.rotary_embeddings.inv_freq, expected_inv_freq)


def test_meta_initialised_model_trains():
    with torch.device("meta"):
        model = NVEsmForMaskedLM(_config())
    model.init_empty_weights("cpu")
    input_ids, attention_mask, labels = make_batch([20, 12])
    loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "tensorrt"}, "backend must be one of"),
        ({"hidden_size": 65}, "divisible by num_attention_heads"),
        ({"position_embedding_type": "absolute"}, "rotary"),
        ({"layer_precision": ["fp8"]}, "layer_precision has 1 entries for 2 layers"),
        ({"layer_precision": ["fp8", "int4"]}, "int4"),
        ({"padded_vocab_size": 16}, "padded_vocab_size"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where TE cannot run")
def test_te_backend_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="backend='te' was requested but cannot run here"):
        NVEsmForMaskedLM(_config(backend="te"))


def test_fp8_layers_on_the_torch_backend_are_refused():
    with pytest.raises(ValueError, match="no fp8_recipe was passed"):
        NVEsmForMaskedLM(_config(layer_precision=["fp8", None]))
    with pytest.raises(ValueError, match="need the TransformerEngine backend"):
        NVEsmForMaskedLM(_config(layer_precision=["fp8", None]), fp8_recipe=object())


def test_auto_backend_falls_back_to_torch_without_te():
    model = NVEsmForMaskedLM(_config(backend="auto"))
    expected = "te" if (torch.cuda.is_available() and _te_importable()) else "torch"
    assert model.backend == expected


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture
def tiny_model(hf_tiny):
    return convert_esm_hf_to_te(hf_tiny, backend="torch").eval()


def test_cu_seq_lens_not_matching_token_count(tiny_model):
    batch = pack(*make_batch([10, 6]))
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 10, 15], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must end at the number of tokens \(16\); it ends at 15"):
        tiny_model(**batch)


def test_cu_seq_lens_must_start_at_zero_and_not_decrease(tiny_model):
    batch = pack(*make_batch([10, 6]))
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([1, 10, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="must start at 0"):
        tiny_model(**batch)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 12, 10, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
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
