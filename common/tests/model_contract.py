"""The model contract: the tests every model package passes, written once for all of them.

A model package describes itself once, as a ``ModelContract``, in its ``tests/test_model_contract.py``::

    from model_contract import *  # noqa: F403  (the contract's tests, collected in this module)
    from model_contract import ModelContract
    from model_contract_export import *  # noqa: F403  (its export part)
    from model_contract_te import *  # noqa: F403  (its TE part, run on GPU machines)

    CONTRACTS = {"esm2": ModelContract(name="esm2", hf_model=..., nv_class=NVEsmForMaskedLM, ...)}

    @pytest.fixture(params=sorted(CONTRACTS))
    def contract(request) -> ModelContract:
        return CONTRACTS[request.param]

and pytest runs every ``test_*`` below against it. Each test compares with a reference that does not come from the
code under test: the stock Hugging Face model (float32, CPU, tight tolerance), a BSHD run of the same batch, each
sequence alone, or the init written in the config. ``CONTRACTS`` is a module-level dict because the torchrun worker
(``scripts/fsdp2_meta_init.py``) looks the contract up by name. The TE backend's part of the contract (GPU
machine) is in ``model_contract_te.py`` and the export's in ``model_contract_export.py``, imported the same way.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from init_statistics import assert_initialised_as_configured
from transformers import PretrainedConfig, PreTrainedModel


SCRIPTS = Path(__file__).resolve().parent / "scripts"

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelContract:
    """What the contract tests need to know about one model (one variant of it: e.g. tied or untied embeddings)."""

    name: str  # the fixture id, and how the torchrun worker finds this contract in CONTRACTS
    hf_model: Callable[[], PreTrainedModel]  # the tiny stock HF model: random weights (no 0s, no 1s), seeded, eval
    nv_class: type[PreTrainedModel]  # the NV model with the LM head, e.g. NVEsmForMaskedLM
    hf_to_nv: Callable[..., PreTrainedModel]  # convert_*_hf_to_te(hf_model, **config_overrides)
    nv_to_hf: Callable[[PreTrainedModel], PreTrainedModel]  # convert_*_te_to_hf(nv_model)
    export: Callable[[Path, Path], Path]  # export_hf_checkpoint(source_dir, output_dir) -> output_dir
    save_nv: Callable[[PreTrainedModel, Path], Path]  # save_nv_checkpoint(nv_model, output_dir) -> output_dir
    auto_class: type  # the Auto class that loads the export, e.g. AutoModelForMaskedLM
    # (lengths, seed=0, padding_side="right") -> {"input_ids", "attention_mask", "labels"}, all [B, S]; -100 at
    # padding and wherever nothing is scored. Every length >= 3.
    make_batch: Callable[..., Batch]
    init_config: Callable[..., PretrainedConfig]  # (**overrides) -> NV config, backend "torch", >= 256 wide
    tokenizer_texts: tuple[str, ...]  # strings the exported tokenizer encodes (two lengths, so there is padding)
    modeling_files: tuple[str, ...]  # the code the export must ship, e.g. ("modeling_esm_te.py", "torch_layers.py")
    te_hf_model: Callable[[], PreTrainedModel]  # a stock model wide enough for TE's fused kernels (GPU tests)
    # More stock models the torch backend must match (other shapes, rope types); the logits/loss test runs on all.
    reference_models: dict[str, Callable[[], PreTrainedModel]] = field(default_factory=dict)
    causal_lm: bool = False  # labels are next-token targets: the model shifts them (a sequence scores length - 1)
    padding_sides: tuple[str, ...] = ("right",)  # the BSHD layouts make_batch builds and the model must accept
    supports_generate: bool = False  # the exported model must generate (GenerationMixin)
    rotary: bool = True  # rotary position embeddings (inv_freq buffers); False: learned absolute positions (BERT)
    tolerance: float = 1e-4  # torch backend vs stock HF in float32: logits and loss (max abs difference)
    grad_atol: float = 1e-5  # ... and gradients (torch.allclose)
    grad_rtol: float = 1e-4
    thd_atol: float = 1e-5  # THD vs BSHD of the same model: logits
    thd_loss_atol: float = 1e-6  # ... and loss
    bf16_tolerance: float = 2e-2  # TE vs torch backend in bf16: relative error of logits, loss
    bf16_grad_tolerance: float = 5e-2  # ... and of gradients
    te_checked_gradients: tuple[str, ...] = ()  # the gradients TE vs torch compares; () means every parameter's

    def stock_models(self) -> dict[str, Callable[[], PreTrainedModel]]:
        return {"tiny": self.hf_model, **self.reference_models}


# ------------------------------------------------------------------------------------------------------- helpers


def pack(batch: Batch) -> Batch:
    """The same batch as THD: real tokens end to end, ``cu_seq_lens`` marking each sequence."""
    keep = batch["attention_mask"].bool()
    lengths = keep.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return {
        "input_ids": batch["input_ids"][keep].unsqueeze(0),
        "labels": batch["labels"][keep].unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }


def torch_model(contract: ModelContract, hf_model: PreTrainedModel | None = None) -> PreTrainedModel:
    return contract.hf_to_nv(contract.hf_model() if hf_model is None else hf_model, backend="torch").eval()


def is_tied(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def max_abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def scored_tokens(labels: torch.Tensor, causal_lm: bool) -> int:
    return int((labels[..., 1:] if causal_lm else labels).ne(-100).sum())


def packing_module(contract: ModelContract):
    """The model package's copy of packing.py (``labeled_token_index`` and friends)."""
    return importlib.import_module(contract.nv_class.__module__.rpartition(".")[0] + ".packing")


def layout(contract: ModelContract, lengths: list[int], name: str, seed: int = 0) -> Batch:
    """``bshd-right``, ``bshd-left`` or ``thd`` (packed from a right-padded batch)."""
    side = "left" if name == "bshd-left" else "right"
    batch = contract.make_batch(lengths, seed=seed, padding_side=side)
    return pack(batch) if name == "thd" else batch


def torchrun(script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Launch a worker of ``scripts/`` as a user does; it puts the package and tests/ on sys.path itself."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores: more threads only oversubscribe
    return subprocess.run(
        [*command, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300, env=env
    )


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The TE (or twin) transformer layers, in order: the modules the model will not split."""
    return [m for m in model.modules() if type(m).__name__ in model._no_split_modules]


# ------------------------------------------------------------------------------ torch backend = stock HF (CPU)


def test_torch_backend_matches_hugging_face_logits_and_loss(contract):
    """Padded BSHD batches (padding in all but the longest row, every padding side the model takes)."""
    for variant, build in contract.stock_models().items():
        hf_model = build()
        nv_model = torch_model(contract, hf_model)
        assert is_tied(nv_model) == hf_model.config.tie_word_embeddings, variant
        for side in contract.padding_sides:
            batch = contract.make_batch([37, 20, 9], padding_side=side)
            if contract.causal_lm:  # a first token is never a target, but HF would score it from the padding before
                first = (batch["attention_mask"].cumsum(1) == 1) & batch["attention_mask"].bool()
                batch["labels"] = batch["labels"].masked_fill(first, -100)
            with torch.no_grad():
                expected, actual = hf_model(**batch), nv_model(**batch)
            where = f"{variant}, {side} padding"
            real = batch["attention_mask"].bool()  # HF's outputs at padding positions carry no meaning
            assert actual.logits.shape == expected.logits.shape == (3, 37, hf_model.config.vocab_size), where
            assert max_abs_difference(actual.logits[real], expected.logits[real]) <= contract.tolerance, where
            assert abs(actual.loss.item() - expected.loss.item()) <= contract.tolerance, where


def test_torch_backend_gradients_match_hugging_face(contract):
    """Every HF parameter's gradient; the NV gradients are mapped to HF names by the converter (exact: it only
    fuses, splits and slices), so fused QKV/MLP and padded vocabulary gradients are compared part by part."""
    hf_model = contract.hf_model()
    nv_model = torch_model(contract, hf_model)
    batch = contract.make_batch([30, 17])
    hf_model(**batch).loss.backward()
    nv_model(**batch).loss.backward()
    gradients = copy.deepcopy(nv_model)
    with torch.no_grad():
        for (name, param), (_, source) in zip(gradients.named_parameters(), nv_model.named_parameters()):
            assert source.grad is not None, f"{name}: no gradient"
            param.copy_(source.grad)
    nv_grads = contract.nv_to_hf(gradients).state_dict()
    compared = 0
    for name, param in hf_model.named_parameters():
        if param.grad is None:  # not used by the forward pass (ESM's contact head)
            continue
        assert torch.allclose(nv_grads[name], param.grad, atol=contract.grad_atol, rtol=contract.grad_rtol), name
        compared += 1
    assert compared >= 5


# -------------------------------------------------------------------------------------------------- conversion


def test_convert_round_trip_is_exact(contract):
    """HF -> NV -> HF gives every state-dict tensor back bit for bit (and the tying), and so does NV -> HF -> NV."""
    hf_model = contract.hf_model()
    nv_model = contract.hf_to_nv(hf_model, backend="torch")
    back = contract.nv_to_hf(nv_model)
    original, returned = hf_model.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    for key in original:
        assert torch.equal(original[key], returned[key]), key
    assert is_tied(back) == hf_model.config.tie_word_embeddings
    again = contract.hf_to_nv(back, backend="torch").state_dict()
    assert again.keys() == nv_model.state_dict().keys()
    for key, value in nv_model.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(again[key], value), key


def test_a_bfloat16_model_keeps_exact_rotary_angles_and_stored_buffers(contract):
    """``model.to(torch.bfloat16)`` (bf16 training weights, Megatron-FSDP's compute weights, a bf16 model for
    inference) rounds the weights, not the positions: each rotary table equals the float32 model's bit for bit (bf16
    frequencies would move the angle at position 1,000 by up to ~0.45 rad), and the float buffers of the state dict
    (ESM-2's contact-regression weights) keep their values, so a checkpoint survives a bf16 model unchanged."""
    model = torch_model(contract)
    rotary = {name: module for name, module in model.named_modules() if hasattr(module, "inv_freq")}
    assert bool(rotary) == contract.rotary
    tables = {name: module(1024) for name, module in rotary.items()}
    buffers = dict(model.named_buffers())
    stored = {k: v.clone() for k, v in model.state_dict().items() if k in buffers and v.is_floating_point()}
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for name, module in rotary.items():
        assert torch.equal(module(1024), tables[name]), name
    state = model.state_dict()
    for key, value in stored.items():
        assert torch.equal(state[key], value), key


def test_conversion_rejects_unknown_hugging_face_weights(contract):
    hf_model = contract.hf_model()
    hf_model.register_buffer("surprise", torch.zeros(2))
    with pytest.raises(ValueError, match="surprise"):
        contract.hf_to_nv(hf_model, backend="torch")


# -------------------------------------------------------------------------------------------------- THD = BSHD


def test_thd_equals_bshd_per_token(contract):
    nv_model = torch_model(contract)
    bshd = contract.make_batch([25, 11, 40, 3])
    with torch.no_grad():
        expected, actual = nv_model(**bshd), nv_model(**pack(bshd))
    real = bshd["attention_mask"].bool()
    assert actual.logits.shape == (1, int(real.sum()), expected.logits.shape[-1])
    assert torch.allclose(actual.logits[0], expected.logits[real], atol=contract.thd_atol)
    assert torch.allclose(actual.loss, expected.loss, atol=contract.thd_loss_atol)


def test_packed_sequences_do_not_see_each_other(contract):
    """Rewriting one packed sequence leaves the other's logits bit for bit as they were (in both directions)."""
    nv_model = torch_model(contract)
    lengths = [15, 22]
    batch = pack(contract.make_batch(lengths))
    other = pack(contract.make_batch(lengths, seed=1))["input_ids"]
    spans = [slice(0, lengths[0]), slice(lengths[0], sum(lengths))]
    with torch.no_grad():
        reference = nv_model(**batch).logits[0]
        for changed, kept in (spans, spans[::-1]):
            input_ids = batch["input_ids"].clone()
            input_ids[0, changed] = other[0, changed]
            logits = nv_model(**{**batch, "input_ids": input_ids}).logits[0]
            assert torch.equal(logits[kept], reference[kept]), f"tokens {changed} reached tokens {kept}"
            assert not torch.allclose(logits[changed], reference[changed])


def test_packed_batch_equals_hugging_face_on_each_sequence_alone(contract):
    """Every packed sequence gets the logits HF gives it alone, and the packed loss is the token-weighted mean of
    HF's per-sequence losses (no prediction across a sequence boundary)."""
    hf_model = contract.hf_model()
    nv_model = torch_model(contract, hf_model)
    lengths = [12, 30, 7]
    batch = contract.make_batch(lengths, seed=3)
    total, count = 0.0, 0
    with torch.no_grad():
        packed = nv_model(**pack(batch))
        for row, logits in enumerate(packed.logits[0].split(lengths)):
            input_ids, labels = batch["input_ids"][row : row + 1, : lengths[row]], batch["labels"][row : row + 1]
            alone = hf_model(input_ids, labels=labels[:, : lengths[row]])
            assert max_abs_difference(logits, alone.logits[0]) <= contract.tolerance, row
            scored = scored_tokens(labels[:, : lengths[row]], contract.causal_lm)
            total, count = total + alone.loss.item() * scored, count + scored
    assert abs(packed.loss.item() - total / count) <= contract.tolerance


def test_loss_without_labelled_tokens_is_zero_not_nan(contract):
    nv_model = torch_model(contract)
    batch = contract.make_batch([10])
    loss = nv_model(**{**batch, "labels": torch.full_like(batch["labels"], -100)}).loss
    assert loss.item() == 0.0


@pytest.mark.parametrize("layout_name", ["bshd-right", "thd"])
def test_labeled_logits_only_gives_the_same_loss_gradients_and_logits(contract, layout_name):
    """The training loops' ``labeled_logits_only=True`` (the head on the labelled tokens only) is the full head read
    at the labelled rows: the same logits there, loss and gradients. Masked LMs only (a causal LM scores every
    token)."""
    if contract.causal_lm:
        pytest.skip("a causal LM scores every token: its forward has no labeled_logits_only")
    batch = layout(contract, [30, 18, 7], layout_name, seed=3)
    full_model, labeled_model, indexed_model = torch_model(contract), torch_model(contract), torch_model(contract)
    full = full_model(**batch)
    labeled = labeled_model(**batch, labeled_logits_only=True)
    # The training loops' way: the labelled rows found on the CPU batch, no search on the device.
    index = packing_module(contract).labeled_token_index(batch["labels"], batch.get("attention_mask"))
    indexed = indexed_model(**batch, labeled_logits_only=True, labeled_token_index=index)
    for output in (full, labeled, indexed):
        output.loss.backward()

    labels = batch["labels"].reshape(-1)
    full_logits = full.logits.reshape(labels.numel(), -1)
    assert labeled.logits.shape == (int((labels != -100).sum()), full_logits.shape[-1])
    torch.testing.assert_close(labeled.logits, full_logits[labels != -100], rtol=0, atol=1e-5)
    torch.testing.assert_close(labeled.loss, full.loss, rtol=0, atol=1e-6)
    assert torch.equal(indexed.logits, labeled.logits) and torch.equal(indexed.loss, labeled.loss)
    full_grads = dict(full_model.named_parameters())
    indexed_grads = dict(indexed_model.named_parameters())
    for name, param in labeled_model.named_parameters():
        torch.testing.assert_close(param.grad, full_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
        assert torch.equal(param.grad, indexed_grads[name].grad), name


def test_labeled_logits_only_without_labels_is_refused(contract):
    if contract.causal_lm:
        pytest.skip("a causal LM scores every token: its forward has no labeled_logits_only")
    batch = contract.make_batch([12])
    del batch["labels"]
    with pytest.raises(ValueError, match="labeled_logits_only=True needs labels"):
        torch_model(contract)(**batch, labeled_logits_only=True)


def test_a_wrong_labeled_token_index_is_refused(contract):
    """An index that does not list exactly the labelled tokens, in packed order, would score the wrong rows."""
    if contract.causal_lm:
        pytest.skip("a causal LM scores every token: its forward has no labeled_logits_only")
    batch = pack(contract.make_batch([20, 9], seed=1))
    model = torch_model(contract)
    index = packing_module(contract).labeled_token_index(batch["labels"])
    unlabeled = (batch["labels"].reshape(-1) == -100).nonzero()[0]
    wrong = {
        "shifted": index + 1,
        "one missing": index[1:],
        "one twice": torch.cat([index[:1], index[:-1]]),
        "out of order": index.flip(0),
        "an unlabelled row": torch.cat([index[:-1], unlabeled]).sort().values,
    }
    for name, bad in wrong.items():
        with pytest.raises((ValueError, IndexError)):
            model(**batch, labeled_logits_only=True, labeled_token_index=bad)
            pytest.fail(f"{name}: accepted")
    with pytest.raises(ValueError, match="labeled_token_index is for labeled_logits_only=True"):
        model(**batch, labeled_token_index=index)


# --------------------------------------------------------------------------------------------------- meta init


def test_meta_init_matches_the_configured_init(contract):
    """Built on the meta device and materialised with init_empty_weights(), the model holds what direct construction
    holds: the init the config describes, the same parameters, tied weights tied, buffers (rotary) recomputed."""
    config = contract.init_config()
    torch.manual_seed(0)
    direct = contract.nv_class(config)
    with torch.device("meta"):
        deferred = contract.nv_class(config)
    assert all(p.is_meta for p in deferred.parameters())
    deferred.init_empty_weights("cpu")
    assert dict(deferred.named_parameters()).keys() == dict(direct.named_parameters()).keys()
    for model in (direct, deferred):
        assert_initialised_as_configured(dict(model.named_parameters()), config)
    assert is_tied(deferred) == config.tie_word_embeddings
    # Buffers (the rotary inverse frequencies, fixed head weights) against the stock HF model of this config.
    direct_buffers = dict(direct.named_buffers())
    for name, buffer in deferred.named_buffers():
        assert not buffer.is_meta and torch.equal(buffer, direct_buffers[name]), name
    hf_inv_freq = [b for n, b in contract.nv_to_hf(deferred).named_buffers() if n.endswith("inv_freq")]
    nv_inv_freq = [b for n, b in deferred.named_buffers() if n.endswith("inv_freq")]
    assert bool(hf_inv_freq) == bool(nv_inv_freq) == contract.rotary
    for buffer in nv_inv_freq:
        assert torch.allclose(buffer, hf_inv_freq[0], rtol=1e-6, atol=0)


def test_meta_initialised_model_trains(contract):
    config = contract.init_config()
    with torch.device("meta"):
        model = contract.nv_class(config)
    model.init_empty_weights("cpu")
    loss = model(**contract.make_batch([20, 12])).loss
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.5  # near-uniform predictions at init
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_sharded_meta_init_on_cpu_two_processes(contract):
    """FSDP2-sharded init on 2 gloo processes: exactly the one-process weights, configured statistics, no two ranks
    alike, and a training step runs (scripts/fsdp2_meta_init.py)."""
    result = torchrun("fsdp2_meta_init.py", "torch", contract.name)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS-OK" in result.stdout


# ----------------------------------------------------------------------------------------- activation recompute


def supports_recompute(contract: ModelContract) -> bool:
    return "recompute_layers" in contract.init_config().to_dict()


def train_step_counting_layer_calls(model: PreTrainedModel, batch: Batch, seed: int = 0):
    """One forward + backward: (loss, {name: gradient}, how often each transformer layer ran)."""
    calls = [0] * len(transformer_layers(model))
    # Pre-hooks: a recompute may stop as soon as it has what backward needs, before the layer's forward returns.
    hooks = [
        layer.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, layer in enumerate(transformer_layers(model))
    ]
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks in every run
    loss = model(**batch).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


def test_activation_recompute_gives_the_same_loss_and_gradients(contract):
    """``config.recompute_layers`` (the first N layers) and HF's ``gradient_checkpointing_enable()`` (all layers):
    those layers run again in backward, and the loss and every gradient equal a plain step's bit for bit (the same
    float32 math on CPU; dropout, where the model has any, draws the same masks in the recompute)."""
    if not supports_recompute(contract):
        pytest.skip(f"{contract.name} has no activation recompute")
    model = torch_model(contract).train()
    layers = len(transformer_layers(model))
    batch = contract.make_batch([30, 17])
    plain_loss, plain_grads, calls = train_step_counting_layer_calls(model, batch)
    assert calls == [1] * layers
    for recompute_layers in (1, layers):
        model.config.recompute_layers = recompute_layers
        loss, grads, calls = train_step_counting_layer_calls(model, batch)
        assert calls == [2] * recompute_layers + [1] * (layers - recompute_layers)
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, plain_grads[name]), (recompute_layers, name)
    model.config.recompute_layers = 0
    model.gradient_checkpointing_enable()
    try:
        loss, grads, calls = train_step_counting_layer_calls(model, batch)
    finally:
        model.gradient_checkpointing_disable()
    assert calls == [2] * layers and torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[name], grad) for name, grad in plain_grads.items())


def test_activation_recompute_is_off_outside_training(contract):
    """Inference (eval mode, or no autograd) keeps no activations for backward: nothing to recompute."""
    if not supports_recompute(contract):
        pytest.skip(f"{contract.name} has no activation recompute")
    model = torch_model(contract)
    model.config.recompute_layers = len(transformer_layers(model))
    batch = contract.make_batch([12, 9])
    calls = [0]
    for layer in transformer_layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    model.eval()(**batch).loss.backward()
    with torch.no_grad():
        model.train()(**batch)
    assert calls == [2 * len(transformer_layers(model))]


# ------------------------------------------------------------------------------------ backends and bad input


@pytest.mark.parametrize(
    "setting",
    [
        "backend",
        "layer_precision_length",
        "layer_precision_value",
        "padded_vocab",
        "recompute_layers",
        "recompute_neg",
    ],
)
def test_bad_config_values_are_named(contract, setting):
    layers = contract.init_config().num_hidden_layers
    if setting.startswith("recompute") and not supports_recompute(contract):
        pytest.skip(f"{contract.name} has no activation recompute")
    overrides, message = {
        "backend": ({"backend": "tensorrt"}, "backend must be one of"),
        "layer_precision_length": ({"layer_precision": ["fp8"]}, f"layer_precision has 1 entries for {layers} layers"),
        "layer_precision_value": ({"layer_precision": ["fp8", "int4"] + [None] * (layers - 2)}, "int4"),
        "padded_vocab": ({"padded_vocab_size": 16}, "padded_vocab_size"),
        "recompute_layers": ({"recompute_layers": layers + 1}, rf"from 0 to num_hidden_layers \({layers}\)"),
        "recompute_neg": ({"recompute_layers": -1}, "recompute_layers must be an integer"),
    }[setting]
    with pytest.raises(ValueError, match=message):
        contract.init_config(**overrides)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where TE cannot run")
def test_te_backend_where_it_cannot_run_is_a_clear_error(contract):
    with pytest.raises(RuntimeError, match="backend='te' was requested but cannot run here"):
        contract.nv_class(contract.init_config(backend="te"))


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def test_auto_backend_falls_back_to_torch_without_te(contract):
    model = contract.nv_class(contract.init_config(backend="auto"))
    assert model.backend == ("te" if torch.cuda.is_available() and _te_importable() else "torch")


def test_quantized_layers_on_the_torch_backend_are_refused(contract):
    config = contract.init_config(layer_precision=["fp8"] + [None] * (contract.init_config().num_hidden_layers - 1))
    with pytest.raises(ValueError, match="no fp8_recipe was passed"):
        contract.nv_class(config)
    with pytest.raises(ValueError, match="need the TransformerEngine backend"):
        contract.nv_class(config, fp8_recipe=object())


def test_layer_autocast_opens_one_region_per_run_of_equal_precision(contract):
    """The models enter TE's autocast once per run of same-precision layers (layer_autocast.py); here with a recording
    stand-in for ``te.autocast`` (the GPU contract counts TE's own scale updates)."""
    import contextlib

    layer_autocast_class = sys.modules[contract.nv_class.__module__].LayerAutocast
    events = []

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        events.append(("enter", enabled, recipe))
        try:
            yield
        finally:
            events.append(("exit", recipe))

    precision = ["fp8", "fp8", None, None, "fp4", "fp8"]
    with layer_autocast_class(precision, {"fp8": "FP8", "fp4": "FP4"}, autocast) as regions:
        for index in range(len(precision)):
            regions.enter_layer(index)
            events.append(index)
    assert events == [
        ("enter", True, "FP8"), 0, 1, ("exit", "FP8"),
        ("enter", False, None), 2, 3, ("exit", None),
        ("enter", True, "FP4"), 4, ("exit", "FP4"),
        ("enter", True, "FP8"), 5, ("exit", "FP8"),
    ]  # fmt: skip

    events.clear()  # no quantized layer, or no TE: nothing entered, a caller's autocast stays in charge
    for precision, te_autocast in (([None] * 3, autocast), (["fp8"] * 3, None)):
        with layer_autocast_class(precision, {"fp8": "FP8"}, te_autocast) as regions:
            for index in range(3):
                regions.enter_layer(index)
    assert events == []

    # An error in a layer closes the open region (and is not swallowed).
    with (
        pytest.raises(RuntimeError, match="layer failed"),
        layer_autocast_class(["fp8"] * 2, {"fp8": "FP8"}, autocast) as regions,
    ):
        regions.enter_layer(0)
        raise RuntimeError("layer failed")
    assert events == [("enter", True, "FP8"), ("exit", "FP8")]


def test_bad_cu_seq_lens_are_named(contract):
    nv_model = torch_model(contract)
    batch = pack(contract.make_batch([10, 6]))

    def with_cu(*boundaries):
        cu = torch.tensor(boundaries, dtype=torch.int32)
        return {**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}

    with pytest.raises(ValueError, match=r"must end at the number of tokens \(16\); it ends at 15"):
        nv_model(**with_cu(0, 10, 15))
    with pytest.raises(ValueError, match="must start at 0"):
        nv_model(**with_cu(1, 10, 16))
    with pytest.raises(ValueError, match="non-decreasing"):
        nv_model(**with_cu(0, 12, 10, 16))


def test_mismatched_thd_keys_and_masks_are_named(contract):
    nv_model = torch_model(contract)
    bshd = contract.make_batch([10, 6])
    batch = pack(bshd)
    with pytest.raises(ValueError, match="cu_seq_lens_k == cu_seq_lens_q"):
        nv_model(**{**batch, "cu_seq_lens_k": torch.tensor([0, 8, 16], dtype=torch.int32)})
    with pytest.raises(ValueError, match="takes no attention_mask"):
        nv_model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
    with pytest.raises(ValueError, match=r"THD input_ids must be \[1, tokens\]"):
        nv_model(**{**batch, "input_ids": batch["input_ids"].view(2, 8)})
    with pytest.raises(ValueError, match="attention_mask"):
        nv_model(bshd["input_ids"], attention_mask=bshd["attention_mask"][:, :5])
    with pytest.raises(ValueError, match="only 0 and 1"):
        nv_model(bshd["input_ids"], attention_mask=bshd["attention_mask"] * 2)


# ------------------------------------------------------------------------------------------------ the contract whole

CONTRACT_PARTS = ("model_contract_export", "model_contract_te")


def test_every_part_of_the_contract_is_collected(request):
    """The model's test module imports every part of the contract (``from <part> import *``): a part left out would
    pass by never running."""
    missing = [
        f"{part}.{name}"
        for part in CONTRACT_PARTS
        for name in vars(importlib.import_module(part))
        if name.startswith("test_") and getattr(request.module, name, None) is None
    ]
    assert not missing, f"{request.module.__name__} does not import these contract tests: {missing}"


# What ``from model_contract import *`` brings into a model's test module: the contract and its tests.
__all__ = ["ModelContract", *(name for name in list(globals()) if name.startswith("test_"))]
