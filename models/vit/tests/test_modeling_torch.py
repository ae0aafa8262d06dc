"""The torch backend against the stock Hugging Face ViT (float32), conversion, export, meta init and bad input.

Every test pins ``backend="torch"``, so it holds on GPU machines too.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForImageClassification
from vit_testing import images, init_config, stock_vit, vit_tiny_shape_at_64_pixels

from vit_te.convert import convert_vit_hf_to_te, convert_vit_te_to_hf
from vit_te.export import export_hf_checkpoint, save_nv_checkpoint
from vit_te.modeling_vit_te import AUTO_MAP, NVViTConfig, NVViTForImageClassification, NVViTModel


TOLERANCE = 1e-4
STOCK_MODELS = {"tiny": stock_vit, "vit-tiny-shape": vit_tiny_shape_at_64_pixels}


def torch_model(hf_model):
    return convert_vit_hf_to_te(hf_model, backend="torch").eval()


def image_size(model) -> int:
    return model.config.image_size


# --------------------------------------------------------------------------------------- torch backend = stock HF


@pytest.mark.parametrize("shape", sorted(STOCK_MODELS))
def test_torch_backend_matches_hugging_face_logits_loss_and_hidden_states(shape):
    hf_model = STOCK_MODELS[shape]()
    nv_model = torch_model(hf_model)
    pixels, labels = images(3, image_size(hf_model)), torch.tensor([0, 4, 2])
    with torch.no_grad():
        expected = hf_model(pixels, labels=labels, output_hidden_states=True)
        actual = nv_model(pixels, labels=labels, output_hidden_states=True)
    assert (actual.logits - expected.logits).abs().max() <= TOLERANCE
    assert abs(actual.loss.item() - expected.loss.item()) <= TOLERANCE
    assert len(actual.hidden_states) == len(expected.hidden_states) == hf_model.config.num_hidden_layers + 1
    for mine, theirs in zip(actual.hidden_states, expected.hidden_states):
        assert (mine - theirs).abs().max() <= TOLERANCE
    with torch.no_grad():
        base, stock_base = nv_model.vit(pixels), hf_model.vit(pixels)
    assert (base.last_hidden_state - stock_base.last_hidden_state).abs().max() <= TOLERANCE
    assert torch.equal(base.pooler_output, base.last_hidden_state[:, 0])


def test_torch_backend_gradients_match_hugging_face():
    """Every parameter's gradient; the NV gradients are mapped to HF names by the converter (exact: it only fuses
    and splits), so the fused QKV gradient is compared part by part."""
    hf_model, pixels, labels = stock_vit(), images(4), torch.tensor([1, 0, 3, 4])
    nv_model = torch_model(hf_model)
    hf_model(pixels, labels=labels).loss.backward()
    nv_model(pixels, labels=labels).loss.backward()
    gradients = copy.deepcopy(nv_model)
    with torch.no_grad():
        for (name, param), (_, source) in zip(gradients.named_parameters(), nv_model.named_parameters()):
            assert source.grad is not None, f"{name}: no gradient"
            param.copy_(source.grad)
    nv_grads = convert_vit_te_to_hf(gradients).state_dict()
    for name, param in hf_model.named_parameters():
        assert torch.allclose(nv_grads[name], param.grad, atol=1e-5, rtol=1e-4), name


def test_interpolated_position_embeddings_match_hugging_face():
    """Fine-tuning at a higher resolution: 48 pixels on a model trained at 32 (a 6x6 grid from 4x4)."""
    hf_model = stock_vit()
    nv_model = torch_model(hf_model)
    pixels = images(2, size=48)
    with torch.no_grad():
        expected = hf_model(pixels, interpolate_pos_encoding=True).logits
        actual = nv_model(pixels, interpolate_pos_encoding=True).logits
    assert (actual - expected).abs().max() <= TOLERANCE


def test_regression_and_multi_label_losses_follow_hugging_face():
    for num_labels, problem_type, labels in (
        (1, None, torch.tensor([0.5, -1.0])),
        (5, "multi_label_classification", torch.tensor([[1.0, 0, 0, 1, 0], [0, 1, 1, 0, 0]])),
    ):
        hf_model = stock_vit(num_labels=num_labels, problem_type=problem_type)
        nv_model = torch_model(hf_model)
        with torch.no_grad():
            expected, actual = hf_model(images(2), labels=labels).loss, nv_model(images(2), labels=labels).loss
        assert abs(actual.item() - expected.item()) <= TOLERANCE, problem_type


# ------------------------------------------------------------------------------------------------------ conversion


def test_convert_round_trip_is_exact():
    hf_model = stock_vit()
    nv_model = convert_vit_hf_to_te(hf_model, backend="torch")
    back = convert_vit_te_to_hf(nv_model)
    original, returned = hf_model.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for key in original:
        assert torch.equal(original[key], returned[key]), key
    again = convert_vit_hf_to_te(back, backend="torch").state_dict()
    for key, value in nv_model.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(again[key], value), key


def test_conversion_rejects_unknown_hugging_face_weights():
    hf_model = stock_vit()
    hf_model.vit.pooler = nn.Linear(64, 64)  # a ViTModel pooler: nothing in NVViTForImageClassification holds it
    with pytest.raises(ValueError, match=r"vit\.pooler\.dense|vit\.pooler\.weight"):
        convert_vit_hf_to_te(hf_model, backend="torch")


# ---------------------------------------------------------------------------------------------------------- export


def export_stock_model(tmp_path: Path):
    hf_model = stock_vit()
    hf_model.save_pretrained(tmp_path / "hf")
    return hf_model, export_hf_checkpoint(tmp_path / "hf", tmp_path / "exported")


def test_export_writes_a_complete_directory_and_config(tmp_path):
    _, out = export_stock_model(tmp_path)
    names = {p.name for p in out.iterdir()}
    wanted = {"config.json", "model.safetensors", "preprocessor_config.json", "README.md", "LICENSE"}
    wanted |= {
        "modeling_vit_te.py",
        "torch_layers.py",
        "torch_attention.py",
        "torch_norm_linear.py",
        "packing.py",
        "meta_init.py",
        "layer_autocast.py",
    }
    assert wanted <= names, sorted(wanted - names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "hf"]  # staged, then renamed
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["NVViTForImageClassification"]
    assert config["backend"] == "auto" and config["layer_precision"] is None
    assert config["model_type"] == "vit"
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["size"] == {"height": 32, "width": 32} and processor["image_mean"] == [0.5, 0.5, 0.5]
    with safe_open(out / "model.safetensors", "pt") as weights:
        keys = list(weights.keys())
    assert keys and not any(key.endswith("_extra_state") for key in keys)


def test_export_loads_offline_and_matches_the_stock_model(tmp_path, monkeypatch):
    hf_model, out = export_stock_model(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForImageClassification.from_pretrained(out, trust_remote_code=True, backend="torch").eval()
    assert type(model).__name__ == "NVViTForImageClassification" and model.backend == "torch"
    assert type(model).__module__ != NVViTForImageClassification.__module__  # the directory's code
    with torch.no_grad():
        assert (model(images(3)).logits - hf_model(images(3)).logits).abs().max() <= TOLERANCE
    stock = convert_vit_te_to_hf(model).state_dict()
    for key, value in hf_model.state_dict().items():
        assert torch.equal(stock[key], value), key


def test_export_drops_a_training_precision_plan_and_keeps_the_callers_config(tmp_path):
    nv_model = convert_vit_hf_to_te(stock_vit(), backend="torch")
    plan = ["fp8"] * nv_model.config.num_hidden_layers  # set after construction: the torch backend refuses to build it
    nv_model.config.layer_precision = plan
    out = save_nv_checkpoint(nv_model, tmp_path / "exported")
    assert json.loads((out / "config.json").read_text())["layer_precision"] is None
    assert nv_model.config.layer_precision == plan and nv_model.config.backend == "torch"


# What a user types in a fresh interpreter: the image processor (no custom code), then the model.
LOAD_AS_A_USER = """
import sys
import numpy as np
from PIL import Image
from transformers import AutoModelForImageClassification, ViTImageProcessor

path, trust = sys.argv[1], sys.argv[2] == "trust"
processor = ViTImageProcessor.from_pretrained(path)
if trust:
    model = AutoModelForImageClassification.from_pretrained(path, trust_remote_code=True)
else:
    model = AutoModelForImageClassification.from_pretrained(path)
image = Image.fromarray((np.arange(40 * 50 * 3) % 251).astype("uint8").reshape(40, 50, 3))
print(type(model).__name__, tuple(model(**processor(image, return_tensors="pt")).logits.shape))
"""


def load_as_a_user(export_dir: Path, trust_remote_code: bool) -> subprocess.CompletedProcess:
    """Run LOAD_AS_A_USER as a batch job would: stdin closed, no network, no GPU, none of the tests' paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    env.update({"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    trust = "trust" if trust_remote_code else "no-trust"
    return subprocess.run(
        [sys.executable, "-c", LOAD_AS_A_USER, str(export_dir), trust],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=export_dir.parent,
    )


def test_export_loads_in_a_fresh_process_without_prompts_or_warnings(tmp_path):
    _, out = export_stock_model(tmp_path)
    result = load_as_a_user(out, trust_remote_code=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "NVViTForImageClassification (1, 5)", result.stdout
    # Allowed on stderr: transformers' "Loading weights" bar, and where torchvision is missing, its note that the
    # image processor uses its Pillow backend.
    printed = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "Loading weights" not in line and "ViTImageProcessorPil" not in line
    ]
    assert not printed, "loading printed:\n" + "\n".join(printed)


def test_export_without_trust_remote_code_is_never_silently_the_stock_model(tmp_path):
    """config.json says the stock model type (so image processors load without custom code). Without
    trust_remote_code, transformers builds its own ViT, which cannot read the fused layers: it reports them."""
    _, out = export_stock_model(tmp_path)
    result = load_as_a_user(out, trust_remote_code=False)
    assert "LOAD REPORT" in result.stderr and ("MISSING" in result.stderr or "MISMATCH" in result.stderr), (
        result.stderr
    )


# ------------------------------------------------------------------------------------------------------- meta init


def test_meta_init_matches_the_configured_init():
    """Built on the meta device and materialised with init_empty_weights(), the model holds the configured init:
    truncated-normal weights of std initializer_range, zero biases, LayerNorms at identity."""
    config = init_config()
    with torch.device("meta"):
        model = NVViTForImageClassification(config)
    assert all(p.is_meta for p in model.parameters())
    model.init_empty_weights("cpu")
    direct = NVViTForImageClassification(config)
    assert dict(model.named_parameters()).keys() == dict(direct.named_parameters()).keys()
    std = config.initializer_range
    for candidate in (model, direct):
        for name, param in candidate.named_parameters():
            if "layer_norm_weight" in name or name.endswith("layernorm.weight"):
                assert torch.equal(param, torch.ones_like(param)), name
            elif name.endswith("bias"):
                assert torch.equal(param, torch.zeros_like(param)), name
            else:  # weight matrices, the class token, the position embeddings
                assert param.abs().max() > 0, name
                if param.numel() >= 10_000:
                    assert abs(param.std().item() - std) < 0.1 * std, (name, param.std().item())
                    assert abs(param.mean().item()) < 0.05 * std, name


def test_a_bf16_model_is_initialised_as_a_float32_one_rounded():
    """FSDP2 with bf16 weights initialises a bf16 meta model. The weights must be the float32 init rounded to bf16, bit
    for bit: torch 2.11's truncated-normal sampler, run in bf16, made ~0.2% of them +-2 (100 standard deviations).
    On the GPU machine this runs on CUDA with torch 2.11, where it failed before the fix; the CPU CI's torch 2.13
    samples truncated normals another way and passes either way."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = init_config()
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = NVViTForImageClassification(config).to(dtype)
        torch.manual_seed(0)
        model.init_empty_weights(device)
        models[dtype] = model
    rounded = {name: p.bfloat16() for name, p in models[torch.float32].named_parameters()}
    for name, param in models[torch.bfloat16].named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param, rounded[name]), name
        assert param.float().abs().max() <= 6 * config.initializer_range or "layer_norm" in name or "layernorm" in name


def test_meta_initialised_model_trains():
    config = init_config()
    with torch.device("meta"):
        model = NVViTForImageClassification(config)
    model.init_empty_weights("cpu")
    loss = model(images(4), labels=torch.tensor([0, 1, 2, 3])).loss
    assert abs(loss.item() - torch.log(torch.tensor(10.0)).item()) < 0.5  # near-uniform predictions at init
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_sharded_meta_init_on_cpu_two_processes():
    """FSDP2-sharded init on 2 gloo processes: exactly the one-process weights, no two ranks' shards alike, and a
    training step runs (scripts/fsdp2_meta_init_vit.py)."""
    script = Path(__file__).parent / "scripts" / "fsdp2_meta_init_vit.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SHARDED-INIT-OK" in result.stdout


# --------------------------------------------------------------------------------------------- backends, bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"backend": "jax"}, "backend must be one of"),
        ({"hidden_act": "relu"}, "hidden_act='gelu'"),
        ({"qkv_bias": False}, "qkv_bias=False"),
        ({"image_size": 30}, "multiple of patch_size"),
        ({"layer_precision": ["fp8"]}, "layer_precision has 1 entries for 2 layers"),
        ({"layer_precision": ["fp16", None]}, "must be None, 'fp8' or 'fp4'"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        init_config(**overrides)


def test_te_backend_where_it_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend='te' was requested but cannot run here"):
        NVViTModel(init_config(backend="te"))


def test_quantized_layers_on_the_torch_backend_are_refused():
    config = init_config(layer_precision=["fp8", None])
    with pytest.raises(ValueError, match="no fp8_recipe was passed"):
        NVViTForImageClassification(config)
    with pytest.raises(ValueError, match="need the TransformerEngine backend"):
        NVViTForImageClassification(config, fp8_recipe=object())


def test_wrong_image_size_and_channels_are_named():
    model = NVViTForImageClassification(init_config()).eval()
    with pytest.raises(
        ValueError, match=r"image size 48x48 does not match the model's 32x32.*interpolate_pos_encoding"
    ):
        model(images(1, size=48))
    with pytest.raises(ValueError, match="pixel_values has 1 channels; the model expects 3"):
        model(torch.zeros(1, 1, 32, 32))
    with pytest.raises(ValueError, match="not a multiple of patch_size 8"):
        model(images(1, size=36), interpolate_pos_encoding=True)


def test_shipped_configs_build_with_hugging_face_parameter_counts():
    """The shipped shapes are the published ones: the same parameter count as the stock ViT of that config."""
    from transformers import ViTConfig, ViTForImageClassification

    for directory in sorted((Path(__file__).parents[1] / "model_configs").iterdir()):
        config = NVViTConfig.from_pretrained(directory, backend="torch")
        stock_config = ViTConfig(
            **{k: v for k, v in config.to_dict().items() if k not in ("backend", "layer_precision")}
        )
        with torch.device("meta"):
            ours = sum(p.numel() for p in NVViTForImageClassification(config).parameters())
            theirs = sum(p.numel() for p in ViTForImageClassification(stock_config).parameters())
        assert ours == theirs, directory.name
    base = NVViTConfig.from_pretrained(Path(__file__).parents[1] / "model_configs" / "vit-base-patch16-224")
    assert (base.hidden_size, base.num_hidden_layers, base.image_size, base.patch_size) == (768, 12, 224, 16)


def test_padding_for_quantized_gemms_changes_no_output():
    """FP8/FP4 layers get the sequence padded to a multiple of 16 tokens with masked keys (17 -> 32 here). The torch
    backend honours the same mask, so with the plan switched on after construction the outputs must not move."""
    hf_model = stock_vit()
    model = torch_model(hf_model)
    pixels, labels = images(3), torch.tensor([0, 1, 2])
    with torch.no_grad():
        expected = model(pixels, labels=labels, output_hidden_states=True)
        model.vit.layer_precision = ["fp8"] * model.config.num_hidden_layers  # the torch backend refuses to build it
        padded, mask_kwargs = model.vit._pad_for_quantized_gemms(torch.zeros(3, 17, 64))
        actual = model(pixels, labels=labels, output_hidden_states=True)
    assert (
        padded.shape == (3, 32, 64) and mask_kwargs["attention_mask"][0, 0, 0].tolist() == [False] * 17 + [True] * 15
    )
    assert (actual.logits - expected.logits).abs().max() <= 1e-5
    assert abs(actual.loss.item() - expected.loss.item()) <= 1e-5
    assert [h.shape for h in actual.hidden_states] == [h.shape for h in expected.hidden_states]


def test_tensor_parallelism_is_refused_where_it_cannot_split(monkeypatch):
    """A tp_group of 2 needs the TE backend and heads and MLP width divisible by 2 (the 2-GPU TE run is in
    test_modeling_te.py); a group of one is no split at all."""
    import vit_te.modeling_vit_te as modeling

    group = object()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2 if g is group else 1)
    config = init_config()
    assert modeling._tensor_parallel_kwargs(config, "te", None) == {}
    with pytest.raises(ValueError, match="needs the TransformerEngine backend"):
        NVViTForImageClassification(init_config(backend="torch"), tp_group=group)
    odd_heads = init_config(num_attention_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by the 2 tensor-parallel ranks"):
        modeling._tensor_parallel_kwargs(odd_heads, "te", group)
    assert modeling._tensor_parallel_kwargs(config, "te", group)["tp_size"] == 2
