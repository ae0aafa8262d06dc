"""The TransformerEngine backend against the pure-PyTorch backend, on a GPU (run on the GPU machine)."""

import pytest
import torch
from esm_testing import TINY_SHAPE, hf_esm2_config, make_batch, pack, randomize_, shape_of
from transformers import AutoModelForMaskedLM, EsmForMaskedLM

from esm2_te.convert import convert_esm_hf_to_te
from esm2_te.export import export_hf_checkpoint
from esm2_te.modeling_esm_te import NVEsmConfig, NVEsmForMaskedLM


pytestmark = [pytest.mark.requires_gpu, pytest.mark.requires_te]

SHAPE_8M = shape_of("esm2_t6_8M_UR50D")


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _torch_and_te_models(shape=SHAPE_8M, dtype=torch.bfloat16, **config_overrides):
    torch.manual_seed(0)
    hf_model = randomize_(EsmForMaskedLM(hf_esm2_config(**shape)))
    torch_model = convert_esm_hf_to_te(hf_model, backend="torch", **config_overrides)
    te_model = NVEsmForMaskedLM(NVEsmConfig(**{**torch_model.config.to_dict(), "backend": "te"}))
    te_model.load_state_dict(torch_model.state_dict(), strict=True)  # identical keys, both directions
    return torch_model.to("cuda", dtype), te_model.to("cuda", dtype)


def _cuda(batch: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_state_dict_keys_are_identical_between_backends():
    torch_model, te_model = _torch_and_te_models(TINY_SHAPE)
    assert te_model.backend == "te" and torch_model.backend == "torch"
    assert set(te_model.state_dict()) == set(torch_model.state_dict())
    torch_model.load_state_dict(te_model.state_dict(), strict=True)


@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_te_matches_torch_in_bf16_forward_and_backward(input_format):
    torch_model, te_model = _torch_and_te_models()
    input_ids, attention_mask, labels = make_batch([200, 130, 77, 250])
    if input_format == "bshd":
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    else:
        batch = pack(input_ids, attention_mask, labels)
    batch = _cuda(batch)
    outputs = {}
    for name, model in (("torch", torch_model), ("te", te_model)):
        out = model(**batch)
        out.loss.backward()
        outputs[name] = out
    real = batch["attention_mask"].bool() if input_format == "bshd" else slice(None)
    assert _relative_error(outputs["te"].logits[real], outputs["torch"].logits[real]) < 2e-2
    assert abs(outputs["te"].loss.item() - outputs["torch"].loss.item()) < 2e-2 * outputs["torch"].loss.item()
    torch_params, te_params = dict(torch_model.named_parameters()), dict(te_model.named_parameters())
    for name in (
        "esm.embeddings.word_embeddings.weight",
        "esm.encoder.layers.0.self_attention.layernorm_qkv.weight",
        "esm.encoder.layers.3.layernorm_mlp.fc1_weight",
        "esm.encoder.layers.5.self_attention.proj.weight",
        "lm_head.dense.weight",
    ):
        assert _relative_error(te_params[name].grad, torch_params[name].grad) < 5e-2, name


def _fp8_recipes():
    from transformer_engine.common import recipe

    return {
        "DelayedScaling": recipe.DelayedScaling(),
        "Float8CurrentScaling": recipe.Float8CurrentScaling(),
        "Float8BlockScaling": recipe.Float8BlockScaling(),
    }


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("input_format", ["bshd", "thd"])
def test_fp8_recipes_train_close_to_bf16(recipe_name, input_format):
    _, bf16_model = _torch_and_te_models()
    fp8_config = NVEsmConfig(**{**bf16_model.config.to_dict(), "layer_precision": ["fp8"] * 6})
    fp8_model = NVEsmForMaskedLM(fp8_config, fp8_recipe=_fp8_recipes()[recipe_name])
    fp8_model.load_state_dict(bf16_model.state_dict())
    fp8_model.to("cuda", torch.bfloat16)
    input_ids, attention_mask, labels = make_batch([200, 131, 77, 250])  # 658 tokens: not a multiple of 16
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    batch = _cuda(batch if input_format == "bshd" else pack(input_ids, attention_mask, labels))
    bf16_loss = bf16_model(**batch).loss
    for _ in range(2):  # the second step exercises the updated scaling factors
        fp8_out = fp8_model(**batch)
        fp8_out.loss.backward()
    assert torch.isfinite(fp8_out.loss)
    assert abs(fp8_out.loss.item() - bf16_loss.item()) < 0.05 * bf16_loss.item()
    grads = [p.grad for p in fp8_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert fp8_model.esm.encoder.layers[0].self_attention.layernorm_qkv.fp8


@pytest.mark.requires_fp8
def test_layer_precision_is_honoured_per_layer():
    from transformer_engine.common import recipe

    _, bf16_model = _torch_and_te_models()
    precision = ["fp8", None, "fp8", None, None, "fp8"]
    model = NVEsmForMaskedLM(
        NVEsmConfig(**{**bf16_model.config.to_dict(), "layer_precision": precision}),
        fp8_recipe=recipe.Float8CurrentScaling(),
    ).to("cuda", torch.bfloat16)
    input_ids, attention_mask, labels = make_batch([64, 32])
    model(input_ids.cuda(), attention_mask=attention_mask.cuda(), labels=labels.cuda()).loss.backward()
    for layer, wanted in zip(model.esm.encoder.layers, precision):
        assert layer.self_attention.layernorm_qkv.fp8 == (wanted == "fp8")
        assert layer.layernorm_mlp.fp8 == (wanted == "fp8")


def test_export_loads_on_gpu_with_te(tmp_path):
    torch.manual_seed(0)
    hf_model = randomize_(EsmForMaskedLM(hf_esm2_config(**TINY_SHAPE))).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    out = export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")
    model = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).to("cuda", torch.bfloat16).eval()
    assert model.backend == "te"
    input_ids, attention_mask, _ = make_batch([40, 25])
    with torch.no_grad():
        actual = model(input_ids.cuda(), attention_mask=attention_mask.cuda()).logits
        expected = hf_model.cuda()(input_ids.cuda(), attention_mask=attention_mask.cuda()).logits
    real = attention_mask.cuda().bool()
    assert _relative_error(actual[real], expected[real]) < 2e-2


def test_meta_init_with_te_on_one_gpu():
    config = NVEsmConfig(**{**SHAPE_8M, "backend": "te"})
    with torch.device("meta"):
        model = NVEsmForMaskedLM(config)
    model.init_empty_weights("cuda")
    std = config.initializer_range
    for name, param in model.named_parameters():
        assert param.device.type == "cuda", name
        if name.endswith(("layer_norm_weight", "layer_norm.weight", "emb_layer_norm_after.weight")):
            assert torch.all(param == 1), name
        elif name.endswith("bias"):
            assert torch.all(param == 0), name
        else:
            assert abs(param.float().std().item() - std) < 0.1 * std, name
    input_ids, attention_mask, labels = make_batch([50, 20])
    loss = model(input_ids.cuda(), attention_mask=attention_mask.cuda(), labels=labels.cuda()).loss
    assert torch.isfinite(loss)
