# Copied from common/tests/model_contract_te.py — edit the source, then run ci/check_copies.py --fix
"""The model contract's TransformerEngine part: the tests a model passes on a GPU machine with TE.

Imported into a model's ``tests/test_model_contract.py`` next to ``model_contract`` (``from model_contract_te import
*``), against the same ``contract`` fixture. TE is pinned to the torch backend (bf16, forward and backward, the same
state-dict keys, the same init), FP8 recipes train close to bf16, and the export loads with TE. Every test carries the
markers of ``conftest.py`` and skips where the hardware is missing.
"""

import pytest
import torch
from init_statistics import assert_initialised_as_configured
from model_contract import (
    ModelContract,
    is_tied,
    layout,
    supports_recompute,
    torchrun,
    train_step_counting_layer_calls,
    transformer_layers,
)
from model_contract_export import export_stock_model
from transformers import PretrainedConfig, PreTrainedModel


# ------------------------------------------------------------------------------------------------------- helpers


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def layouts(contract: ModelContract) -> list[str]:
    return [f"bshd-{side}" for side in contract.padding_sides] + ["thd"]


def torch_and_te_models(contract: ModelContract, hf_model: PreTrainedModel, dtype=torch.bfloat16, **overrides):
    """The torch and TE backends holding the same weights, on the GPU."""
    torch_nv = contract.hf_to_nv(hf_model, backend="torch", **overrides)
    te_nv = contract.nv_class(type(torch_nv.config)(**{**torch_nv.config.to_dict(), "backend": "te"}))
    te_nv.load_state_dict(torch_nv.state_dict(), strict=True)  # identical keys, both directions
    return torch_nv.to("cuda", dtype), te_nv.to("cuda", dtype)


def cuda(batch: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def qkv_projection(layer: torch.nn.Module) -> torch.nn.Module:
    """The fused QKV module of a TE layer: ``layernorm_qkv`` (pre-norm) or ``qkv`` (post-norm, BERT)."""
    attention = layer.self_attention
    return attention.layernorm_qkv if hasattr(attention, "layernorm_qkv") else attention.qkv


def mlp_projection(layer: torch.nn.Module) -> torch.nn.Module:
    """The first FFN module of a TE layer: ``layernorm_mlp`` (``te.TransformerLayer``) or ``mlp.fc1`` (a layer built
    from TE modules, CodonFM's Encodon)."""
    return layer.layernorm_mlp if hasattr(layer, "layernorm_mlp") else layer.mlp.fc1


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_state_dict_keys_are_identical_between_backends(contract):
    hf_model = contract.hf_model()
    torch_nv, te_nv = torch_and_te_models(contract, hf_model)
    assert te_nv.backend == "te" and torch_nv.backend == "torch"
    assert set(te_nv.state_dict()) == set(torch_nv.state_dict())
    torch_nv.load_state_dict(te_nv.state_dict(), strict=True)
    assert is_tied(te_nv) == hf_model.config.tie_word_embeddings


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_te_matches_torch_in_bf16_forward_and_backward(contract):
    """Logits, loss and every gradient, in each layout the model takes (BSHD padded on each side it supports, THD)."""
    torch_nv, te_nv = torch_and_te_models(contract, contract.te_hf_model())
    for name in layouts(contract):
        batch = cuda(layout(contract, [200, 130, 77, 250], name))
        outputs = {}
        for backend, model in (("torch", torch_nv), ("te", te_nv)):
            model.zero_grad()
            out = model(**batch)
            out.loss.backward()
            outputs[backend] = out
        real = batch["attention_mask"].bool() if name != "thd" else slice(None)
        error = relative_error(outputs["te"].logits[real], outputs["torch"].logits[real])
        assert error < contract.bf16_tolerance, (name, error)
        torch_loss, te_loss = outputs["torch"].loss.item(), outputs["te"].loss.item()
        assert abs(te_loss - torch_loss) < contract.bf16_tolerance * torch_loss, (name, te_loss, torch_loss)
        te_params = dict(te_nv.named_parameters(remove_duplicate=False))
        torch_params = dict(torch_nv.named_parameters(remove_duplicate=False))
        checked = contract.te_checked_gradients or [n for n, p in torch_params.items() if p.grad is not None]
        for param_name in checked:
            error = relative_error(te_params[param_name].grad, torch_params[param_name].grad)
            assert error < contract.bf16_grad_tolerance, (name, param_name, error)


def _fp8_recipes() -> dict:
    from transformer_engine.common import recipe

    return {
        "DelayedScaling": recipe.DelayedScaling(),
        "Float8CurrentScaling": recipe.Float8CurrentScaling(),
        "Float8BlockScaling": recipe.Float8BlockScaling(),
    }


@pytest.mark.requires_fp8
@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("input_format", ["bshd-right", "thd"])
def test_fp8_recipes_train_close_to_bf16(contract, recipe_name, input_format):
    _, bf16_model = torch_and_te_models(contract, contract.te_hf_model())
    layers = bf16_model.config.num_hidden_layers
    fp8_config = type(bf16_model.config)(**{**bf16_model.config.to_dict(), "layer_precision": ["fp8"] * layers})
    fp8_model = contract.nv_class(fp8_config, fp8_recipe=_fp8_recipes()[recipe_name])
    fp8_model.load_state_dict(bf16_model.state_dict())
    fp8_model.to("cuda", torch.bfloat16)
    batch = cuda(layout(contract, [200, 131, 77, 250], input_format))  # 658 tokens: not a multiple of 16
    with torch.no_grad():
        bf16_loss = bf16_model(**batch).loss
    layer_tokens = []  # what the first layer is handed: the packed tokens, padded (packing.FP8_TOKEN_ALIGNMENT)
    hook = transformer_layers(fp8_model)[0].register_forward_pre_hook(
        lambda module, args: layer_tokens.append(args[0].numel() // args[0].shape[-1])
    )
    for _ in range(2):  # the second step exercises the updated scaling factors
        fp8_out = fp8_model(**batch)
        fp8_out.loss.backward()
    hook.remove()
    # 768: a multiple of 128, where TE's FP8 gradient casts take their fast kernels (a multiple of 16 would be legal)
    assert layer_tokens == [768, 768], layer_tokens
    assert torch.isfinite(fp8_out.loss)
    assert abs(fp8_out.loss.item() - bf16_loss.item()) < 0.05 * bf16_loss.item()
    grads = [p.grad for p in fp8_model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert qkv_projection(transformer_layers(fp8_model)[0]).fp8


@pytest.mark.requires_fp8
def test_layer_precision_is_honoured_per_layer(contract):
    from transformer_engine.common import recipe

    _, bf16_model = torch_and_te_models(contract, contract.te_hf_model())
    precision = ["fp8" if i % 3 == 0 else None for i in range(bf16_model.config.num_hidden_layers)]
    model = contract.nv_class(
        type(bf16_model.config)(**{**bf16_model.config.to_dict(), "layer_precision": precision}),
        fp8_recipe=recipe.Float8CurrentScaling(),
    ).to("cuda", torch.bfloat16)
    model(**cuda(contract.make_batch([64, 32]))).loss.backward()
    for layer, wanted in zip(transformer_layers(model), precision, strict=True):
        assert qkv_projection(layer).fp8 == (wanted == "fp8")
        assert mlp_projection(layer).fp8 == (wanted == "fp8")


def _count_scale_updates(monkeypatch) -> list[str]:
    """The list that TE's delayed-scaling updates append "forward" or "backward" to, each time one runs."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    updates = []
    update = FP8GlobalStateManager.reduce_and_update_fp8_tensors

    def counted_update(forward: bool = True) -> None:
        updates.append("forward" if forward else "backward")
        update(forward=forward)

    monkeypatch.setattr(FP8GlobalStateManager, "reduce_and_update_fp8_tensors", staticmethod(counted_update))
    return updates


@pytest.mark.requires_fp8
def test_delayed_scaling_updates_the_scales_once_per_run_of_fp8_layers(contract, monkeypatch):
    """DelayedScaling updates every amax history and scale of the model at each exit from an outermost TE autocast (and
    at the end of the backward of each autocast region): once per run of FP8 layers, not once per layer
    (layer_autocast.py). Before, a model with L FP8 layers rolled each amax history L times per step."""
    from transformer_engine.common import recipe

    updates = _count_scale_updates(monkeypatch)
    _, bf16_model = torch_and_te_models(contract, contract.te_hf_model())
    layers = bf16_model.config.num_hidden_layers
    assert layers >= 4
    batch = cuda(contract.make_batch([64, 32]))

    def train_step(precision: list) -> None:
        model = contract.nv_class(
            type(bf16_model.config)(**{**bf16_model.config.to_dict(), "layer_precision": precision}),
            fp8_recipe=recipe.DelayedScaling(),
        ).to("cuda", torch.bfloat16)
        updates.clear()
        model(**batch).loss.backward()
        for layer, wanted in zip(transformer_layers(model), precision, strict=True):
            assert qkv_projection(layer).fp8 == (wanted == "fp8")

    train_step(["fp8"] * layers)  # one region
    assert updates == ["forward", "backward"]

    precision = ["fp8"] * layers
    precision[2] = None  # three regions: FP8 [0, 1], high precision [2], FP8 [3, layers)
    train_step(precision)
    assert updates.count("forward") == 2, updates  # per layer, it was layers - 1
    # At most one per region. The high-precision region may add one: TE's operation fuser (used inside some TE layers,
    # Geneformer's post-norm one on TE 2.20) takes a region's first-module flag without checking for FP8.
    assert updates.count("backward") in (2, 3), updates


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_export_loads_on_gpu_with_te(contract, tmp_path):
    hf_model, out = export_stock_model(contract, tmp_path)
    model = contract.auto_class.from_pretrained(out, trust_remote_code=True).to("cuda", torch.bfloat16).eval()
    assert model.backend == "te"
    side = "left" if "left" in contract.padding_sides else "right"
    batch = cuda(contract.make_batch([40, 25], padding_side=side))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        actual = model(**inputs).logits
        expected = hf_model.cuda()(**inputs).logits  # the stock model in float32
    real = batch["attention_mask"].bool()
    assert relative_error(actual[real], expected[real]) < contract.bf16_tolerance
    if contract.supports_generate:
        pad = hf_model.config.pad_token_id
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=5, pad_token_id=pad, eos_token_id=None)
        assert generated.shape == (2, 45)


def _meta_initialised_on_gpu(contract: ModelContract, backend: str) -> tuple[PreTrainedModel, PretrainedConfig]:
    config = contract.init_config(backend=backend)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = contract.nv_class(config)
    model.init_empty_weights("cuda")
    return model, config


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_meta_init_with_te_on_one_gpu(contract):
    """TE layers built on the meta device and initialised on the GPU hold the configured init, and train."""
    model, config = _meta_initialised_on_gpu(contract, "te")
    assert model.backend == "te"
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert_initialised_as_configured(dict(model.named_parameters()), config)
    loss = model(**cuda(contract.make_batch([50, 20]))).loss
    assert torch.isfinite(loss)


@pytest.mark.requires_gpu
@pytest.mark.requires_te
def test_te_and_torch_backends_initialise_the_same_numbers_on_gpu(contract):
    """From the same seed on the GPU, TE's layers and the torch twins draw exactly the same weights (so a run's
    init does not depend on the backend)."""
    te_model, _ = _meta_initialised_on_gpu(contract, "te")
    twin_model, _ = _meta_initialised_on_gpu(contract, "torch")
    te, twins = dict(te_model.named_parameters()), dict(twin_model.named_parameters())
    assert te.keys() == twins.keys()
    for name, value in te.items():
        assert torch.equal(value, twins[name]), f"{name}: TE and torch backends initialised it differently"


@pytest.mark.requires_te
def test_sharded_meta_init_with_te_two_ranks_on_one_gpu(contract):
    """The TE path of sharded init (each rank keeps its slice of one init) on a one-GPU machine: two gloo ranks."""
    result = torchrun("fsdp2_meta_init.py", "te-shared-gpu", contract.name)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


@pytest.mark.requires_te
@pytest.mark.requires_multi_gpu
def test_sharded_meta_init_with_te_two_gpus(contract):
    result = torchrun("fsdp2_meta_init.py", "te", contract.name)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


@pytest.mark.requires_gpu
@pytest.mark.requires_te
@pytest.mark.parametrize(
    "recipe_name",
    [
        None,
        pytest.param("DelayedScaling", marks=pytest.mark.requires_fp8),
        pytest.param("Float8CurrentScaling", marks=pytest.mark.requires_fp8),
        pytest.param("Float8BlockScaling", marks=pytest.mark.requires_fp8),
    ],
)
def test_activation_recompute_with_te_trains_like_keeping_activations(contract, recipe_name):
    """TE layers recomputed (activation_recompute.py; bf16, and each FP8 recipe where the GPU has it): two steps give
    the plain run's losses (the same forward kernels; delayed scaling recomputes with the scales its first forward
    used) and its gradients up to the backward kernels' own run-to-run differences, with less peak memory. Equal
    gradients pass before their relative error is taken: under delayed scaling the first step casts gradients to E5M2
    with a scale of 1, and some (ESM-2's first layer-norm weight's) are then exactly zero in every run, plain or
    recomputed, where a relative error is 0/0."""
    if not supports_recompute(contract):
        pytest.skip(f"{contract.name} has no activation recompute")
    _, bf16_model = torch_and_te_models(contract, contract.te_hf_model())
    layers = bf16_model.config.num_hidden_layers
    config = type(bf16_model.config)(
        **{**bf16_model.config.to_dict(), "layer_precision": ["fp8"] * layers if recipe_name else None}
    )
    batch = cuda(layout(contract, [256] * 16, "thd"))  # 4096 tokens: activations outweigh this small model
    runs = {}
    for recompute_layers in (0, layers):
        fp8_recipe = _fp8_recipes()[recipe_name] if recipe_name else None
        model = contract.nv_class(config, fp8_recipe=fp8_recipe).to("cuda", torch.bfloat16).train()
        model.load_state_dict(bf16_model.state_dict())
        model.config.recompute_layers = recompute_layers
        steps = []
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss, grads, calls = train_step_counting_layer_calls(model, batch)
            steps.append((loss, grads, torch.cuda.max_memory_allocated() - before))
        assert calls == [2 if recompute_layers else 1] * layers
        runs[recompute_layers] = steps
    for (plain_loss, plain_grads, plain_peak), (loss, grads, peak) in zip(runs[0], runs[layers], strict=True):
        assert torch.equal(loss, plain_loss), (loss.item(), plain_loss.item())
        for name, grad in plain_grads.items():
            assert torch.equal(grads[name], grad) or relative_error(grads[name], grad) < 1e-2, name
        assert peak < 0.75 * plain_peak, (peak, plain_peak)


def _delayed_scaling_state(model: PreTrainedModel) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, amax history, scale) of every delayed-scaling state of ``model``'s TE modules, forward and backward."""
    states = []
    for name, module in model.named_modules():
        for direction in ("scaling_fwd", "scaling_bwd"):
            meta = getattr(module, "fp8_meta", {}).get(direction)
            if meta is not None:
                states.append((f"{name}.{direction}", meta.amax_history.clone(), meta.scale.clone()))
    return states


@pytest.mark.requires_fp8
@pytest.mark.parametrize("switch", ["recompute_layers", "gradient_checkpointing"])
def test_activation_recompute_keeps_delayed_scaling_updates_once_per_step(contract, monkeypatch, switch):
    """Recomputed DelayedScaling layers update the scales and roll the amax histories once per step and direction, as
    the plain run does (``te.distributed.checkpoint`` of TE 2.20 updates them once more per recomputed layer in
    backward), and three steps leave the plain run's histories: the same rows filled, amaxes and scales within the
    backward kernels' run-to-run differences (TE's attention is built deterministic here)."""
    if not supports_recompute(contract):
        pytest.skip(f"{contract.name} has no activation recompute")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # read when TE's attention is built
    updates = _count_scale_updates(monkeypatch)
    _, bf16_model = torch_and_te_models(contract, contract.te_hf_model())
    layers = bf16_model.config.num_hidden_layers
    config = type(bf16_model.config)(**{**bf16_model.config.to_dict(), "layer_precision": ["fp8"] * layers})
    batch = cuda(layout(contract, [256] * 8, "thd"))
    runs = {}
    for recompute in (False, True):
        model = contract.nv_class(config, fp8_recipe=_fp8_recipes()["DelayedScaling"]).to("cuda", torch.bfloat16)
        model.load_state_dict(bf16_model.state_dict())
        model.train()
        if recompute and switch == "recompute_layers":
            model.config.recompute_layers = layers
        elif recompute:
            model.gradient_checkpointing_enable()
        losses = []
        for _ in range(3):
            updates.clear()
            loss, _, calls = train_step_counting_layer_calls(model, batch)
            assert updates == ["forward", "backward"], (recompute, updates)
            assert calls == [2 if recompute else 1] * layers
            losses.append(loss)
        runs[recompute] = (losses, _delayed_scaling_state(model))
    (plain_losses, plain_state), (losses, state) = runs[False], runs[True]
    assert torch.equal(losses[0], plain_losses[0])  # the first forward: the same kernels and scales
    assert torch.allclose(torch.stack(losses), torch.stack(plain_losses), rtol=1e-3)
    assert [name for name, *_ in state] == [name for name, *_ in plain_state] and state
    for (name, history, scale), (_, plain_history, plain_scale) in zip(state, plain_state, strict=True):
        assert torch.equal(history != 0, plain_history != 0), name  # the same rows, rolled as often
        assert torch.allclose(history, plain_history, rtol=1e-2), name
        assert torch.allclose(scale, plain_scale, rtol=1e-2), name
    assert any((history != 0).any(dim=-1).sum() >= 3 for _, history, _ in state)  # the steps left their rows


__all__ = [name for name in list(globals()) if name.startswith("test_")]
