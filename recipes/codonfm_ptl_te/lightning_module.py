"""The LightningModules: Encodon masked-LM pre-training and sequence-level fine-tuning.

Both build their Hugging Face model in ``configure_model``, Lightning's hook for models that a strategy shards (see
model_setup.py): whole on the device for DDP and FSDP (Lightning wraps each ``EncodonLayer`` afterwards), on the meta
device then ``fully_shard``-ed per layer and materialised for FSDP2 (``ModelParallelStrategy``). Both use AdamW with the
warmup + linear-decay schedule (scheduler.py) stepped once per optimizer step, decaying the weight matrices and
embedding tables but not the biases and LayerNorm weights (weight_decay.py; the published CodonFM training code's
groups), clip the gradient norm themselves (``configure_gradient_clipping``: Lightning's own clipping refuses FSDP,
and the norm before clipping is logged), and log ``train_loss`` and ``val_loss``.

Batches are the datamodule's dicts, passed to the model as keyword arguments: BSHD (``input_ids``, ``attention_mask``,
``labels``) or THD (packed ``input_ids`` with ``cu_seq_lens_q/k`` and ``max_length_q/k``), the names the model takes.

Loss and gradient: a masked-LM micro-batch's loss is the mean over its masked codons, and ``training_step`` returns
it weighted by ``n * dp / N`` (:func:`EncodonModule.data_parallel_token_weight`): ``n`` this rank's masked codons,
``N`` those of the micro-batch on all ``dp`` data-parallel ranks. DDP, FSDP and FSDP2 average the ranks' gradients, so
the micro-batch's gradient is the mean over all of its masked codons on all ranks, however they fall: a rank that drew
fewer does not weigh each of its codons more (2 ranks x 1 sequence == 1 rank x 1 batch of both sequences,
tests/test_train.py). The micro-batches of one optimizer step (``trainer.accumulate_grad_batches``) keep Lightning's
convention, each divided by their number: Lightning does not show ``training_step`` the step's other micro-batches, so
they cannot be weighted by their share of the step's codons. One process: the weight is 1 and nothing is reduced.

Dropout draws from a generator reseeded at every micro-batch from (seed, optimizer step, micro-batch, rank): a resumed
run draws the same masks as an uninterrupted one, whatever else (validation, data-loader workers) used the global RNG
in between, and ranks draw different masks.
"""

import logging

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from fp8_calibration import calibrate_delayed_scaling, uses_delayed_scaling
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from model_setup import (
    build_model,
    check_backend,
    fsdp1_weight_decay_groups,
    fsdp2_policy,
    is_pretraining,
    load_encoder_weights,
    load_model_config,
    model_flops,
    read_pretrained_weights,
    shard_with_fsdp2,
)
from modeling_codonfm_te import NVEncodonConfig
from omegaconf import DictConfig, OmegaConf
from optimizer_settings import configured_settings, restore_configured_settings
from packing import IGNORE_INDEX, with_labeled_token_index
from quantization import check_quantization_supported
from scheduler import get_linear_schedule_with_warmup
from torchmetrics import MeanMetric, MeanSquaredError, PearsonCorrCoef
from torchmetrics.classification import MulticlassAccuracy
from user_errors import ConfigError
from weight_decay import no_weight_decay_names, weight_decay_groups


logger = logging.getLogger(__name__)


class EncodonModule(L.LightningModule):
    """What pre-training and fine-tuning share: the model's construction, optimizer, schedule, clipping, seeding."""

    pretraining = True

    def __init__(self, cfg: DictConfig):
        super().__init__()
        self.cfg = cfg
        try:  # the run's settings, resolved, go into every checkpoint (hyper_parameters)
            self.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))
        except Exception:  # ${hydra:...} outside a Hydra run (tests that build a module directly)
            self.save_hyperparameters(OmegaConf.to_container(cfg, resolve=False))
        self.model_config, self.plan = load_model_config(cfg)
        self.model = None  # built by configure_model, once the strategy (and its device mesh) exists
        self.model_flops = None
        self._built_parameters: dict[str, int] = {}  # configure_model: every parameter's name and size, as built
        self._no_weight_decay: set[str] = set()  # and the names of those AdamW leaves undecayed
        self.last_grad_norm: torch.Tensor | None = None  # before clipping, of the last optimizer step
        self._rng_step, self._micro_batch = -1, 0
        # DelayedScaling: FP8 scales set on the fit's first batch before it trains (fp8_calibration.py).
        self._calibrate_fp8_scales = bool(cfg.fp8_config.get("calibrate_delayed_scaling", True)) and (
            uses_delayed_scaling(self.plan.fp8_recipe)
        )
        self._calibrating = False  # the calibration passes run training_step: no logging then
        self.strict_loading = False  # checkpoints leave TE's _extra_state out; on_load_checkpoint checks the names

    # ------------------------------------------------------------------------------------------- building

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls the hook again for validate/predict after fit
            return
        strategy = self.trainer.strategy
        device = strategy.root_device
        fsdp2 = isinstance(strategy, ModelParallelStrategy)
        model = build_model(self.model_config, self.plan, self.pretraining, "meta" if fsdp2 else device)
        self.model_flops = model_flops(model, self.model_config)
        # What AdamW leaves undecayed, decided on the model as built (whole shapes, on the meta device too): FSDP1
        # wraps it before configure_optimizers, where every parameter is a flat 1-D shard under a wrapped name.
        self._built_parameters = {name: param.numel() for name, param in model.named_parameters()}
        self._no_weight_decay = no_weight_decay_names(model)
        if fsdp2:
            policy = fsdp2_policy(self.trainer.precision, device)
            mesh = self.device_mesh["data_parallel"]
            shard_with_fsdp2(model, mesh, policy, bool(self.cfg.fsdp.reshard_after_forward))
            model.init_empty_weights(device)  # each rank materialises and initialises only its own shards
        self.model = model
        self.load_initial_weights()

    def load_initial_weights(self) -> None:
        """Pre-training starts from the init; fine-tuning overrides this."""

    def check_hardware(self, device: torch.device) -> None:
        """Fail before any work, in one line, when ``device`` cannot run this model: backend=te without TE, FP8 on a
        CPU or on a GPU without FP8 tensor cores."""
        check_backend(self.model_config)
        check_quantization_supported(self.plan, device)

    def configure_optimizers(self):
        # Two groups: adamw_kwargs.weight_decay on the weight matrices and embedding tables, none on the biases and
        # LayerNorm weights (TE's fused LayerNormLinear/LayerNormMLP ones too): weight_decay.py.
        weight_decay = self.cfg.adamw_kwargs.weight_decay
        if isinstance(self.trainer.strategy, FSDPStrategy):  # FSDP1's flat shards: split by the names as built
            groups = fsdp1_weight_decay_groups(self.model, weight_decay, self._built_parameters, self._no_weight_decay)
        else:  # the model itself (DDP wraps the LightningModule), or FSDP2's DTensors (ndim of the whole tensor)
            groups = weight_decay_groups(self.model, weight_decay)
        fused = self.trainer.strategy.root_device.type == "cuda"
        optimizer = torch.optim.AdamW(groups, **self.cfg.adamw_kwargs, fused=fused)
        scheduler = get_linear_schedule_with_warmup(optimizer, **self.cfg.lr_scheduler_kwargs)
        self._configured_optimizer = configured_settings(optimizer, scheduler)  # before a resume overwrites them
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def on_train_start(self) -> None:
        # Lightning has restored a resumed run's optimizer and schedule by now, with the settings of the run that
        # saved them. AdamW's moments and the schedule's step stay; lr, betas, eps, weight decay and the peak lr are
        # this run's config again (optimizer_settings.py), so a resume with a lower adamw_kwargs.lr trains with it.
        if self.trainer.ckpt_path is not None:
            restore_configured_settings(
                self.trainer.optimizers[0],
                self.trainer.lr_scheduler_configs[0].scheduler,
                self._configured_optimizer,
                str(self.trainer.ckpt_path),
            )

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip the global gradient norm to ``max_grad_norm`` (null: only measure it) and keep the norm for logging."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        if isinstance(self.trainer.strategy, FSDPStrategy):
            norm = self.trainer.model.clip_grad_norm_(max_norm)  # FSDP1: the norm over all ranks' flat shards
        else:  # DDP, or FSDP2's DTensor gradients (the norm is then a DTensor; perf_logger makes it whole)
            norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm)
        self.last_grad_norm = norm.detach()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._calibrate_fp8_scales:
            self._calibrate_fp8_scales = False
            self._calibrate_delayed_scaling(batch, batch_idx)
        step = self.trainer.global_step
        self._micro_batch = self._micro_batch + 1 if step == self._rng_step else 0
        self._rng_step = step
        torch.manual_seed(dropout_seed(self.cfg.seed, step, self._micro_batch, self.global_rank))

    def _calibrate_delayed_scaling(self, batch, batch_idx) -> None:
        """Forward/backward passes on this batch through the strategy (DDP/FSDP wrapper, precision context), the
        loss weighted as ``training_step`` weights it and divided as Lightning divides it over accumulated
        micro-batches; the gradients are discarded. (Every rank runs the same number of passes, as fp8_calibration
        decides it over all ranks, so the weight's all-reduce stays matched.)"""

        def forward_backward() -> None:
            loss = self.trainer.strategy.training_step(batch, batch_idx)
            (loss / self.trainer.accumulate_grad_batches).backward()

        self._calibrating = True
        try:
            calibrate_delayed_scaling(self.model, forward_backward, zero_grad=lambda: self.zero_grad(set_to_none=True))
        finally:
            self._calibrating = False

    def log_training_loss(self, loss: torch.Tensor) -> None:
        """``train_loss``: this rank's micro-batch mean, unweighted (metrics.jsonl's loss is PerfCallback's)."""
        if not self._calibrating:
            self.log("train_loss", loss.detach(), on_step=True, on_epoch=False)

    def data_parallel_group(self):
        """The process group over the data-parallel ranks, or None in a single process without one. Every process
        of this recipe is one data-parallel rank: DDP and FSDP (``FSDPStrategy``, full or grad-op sharding, never
        hybrid) over the world, FSDP2 over its mesh's ``data_parallel`` dimension (tensor_parallel_size=1, so that
        too is the world)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            return self.device_mesh["data_parallel"].get_group()
        return dist.group.WORLD

    def data_parallel_token_weight(self, scored: int) -> torch.Tensor | None:
        """``scored * dp / N`` for a micro-batch whose mean loss is over ``scored`` tokens on this rank, ``N`` the
        micro-batch's scored tokens on all ``dp`` data-parallel ranks (clamped to 1: a micro-batch with none weighs
        nothing); None, meaning a weight of exactly 1, with one data-parallel rank. The count is a host number (no
        sync), written on the device by ``torch.full`` and all-reduced there: the weight stays on the device."""
        group = self.data_parallel_group()
        if group is None or dist.get_world_size(group) == 1:
            return None
        total = torch.full((), float(scored), device=self.device)
        dist.all_reduce(total, group=group)
        return scored * dist.get_world_size(group) / total.clamp(min=1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The model's shape travels with its weights: fine-tuning and predict.py rebuild it from the checkpoint alone.
        checkpoint["model_config"] = self.model_config.to_dict()
        # TE's `_extra_state` is FP8 scaling bookkeeping, not weights: checkpoints hold weights only, as exports do. (A
        # resumed DelayedScaling run rebuilds its amax history; FSDP2's load: checkpoint_io.extra_state_kept_when_absent.)
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if not k.endswith("_extra_state")
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Loading is not strict (the checkpoint has no `_extra_state`), so check the weights' names here. (FSDP2's
        # ModelParallelStrategy has loaded and removed them already: there a shape mismatch still fails its load.)
        if "state_dict" not in checkpoint:
            return
        saved = set(checkpoint["state_dict"])
        expected = {k for k in self.state_dict() if not k.endswith("_extra_state")}
        if saved != expected:
            missing, extra = sorted(expected - saved), sorted(saved - expected)
            raise ConfigError(
                f"the checkpoint holds another model (missing {missing[:3]}, unexpected {extra[:3]}): resume with the "
                "model_tag and model_config_overrides that wrote it, or start afresh in a new output_dir"
            )


def dropout_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A seed that depends on every argument, mixed so that neighbouring steps and ranks get unrelated streams."""
    return int(np.random.SeedSequence([seed, step, micro_batch, rank]).generate_state(1, np.uint64)[0] >> 1)


class EncodonPretrainModule(EncodonModule):
    """Masked-codon pre-training: the loss is the mean cross-entropy over the masked codons."""

    pretraining = True

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.val_loss = MeanMetric()  # weighted by masked codons: the token mean over the whole validation set

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        # Where the masked codons sit, found on the CPU before Lightning moves the batch (on the GPU that would cost
        # a host sync per step): the model runs its head on them only.
        return with_labeled_token_index(batch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # The masked codons' count is the length of their index, found on the CPU: a shape, no host sync.
        weight = self.data_parallel_token_weight(batch["labeled_token_index"].numel())
        # The head runs only on the masked codons: the loss is the same, without logits nobody reads.
        loss = self.model(**batch, labeled_logits_only=True).loss
        self.log_training_loss(loss)
        # Weighted by this rank's share of the micro-batch's masked codons on all ranks (module docstring). Lightning
        # divides it by accumulate_grad_batches; PerfCallback's step loss, averaged over the ranks, is then the average
        # over the step's micro-batches of each one's mean over its masked codons on all ranks.
        return loss if weight is None else loss * weight

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = self.model(**batch, labeled_logits_only=True).loss
        self.val_loss.update(loss.detach(), weight=(batch["labels"] != IGNORE_INDEX).sum())
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True)


class EncodonFinetuneModule(EncodonModule):
    """A sequence-level head (regression or classification, ``finetune.problem_type``) on the encoder, which starts
    from ``finetune.init_from``: an export (``final_model/``) or a Lightning checkpoint of pre-training."""

    pretraining = False

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.val_loss = MeanMetric()  # weighted by sequences
        if self.model_config.problem_type == "regression":
            self.val_metrics = torch.nn.ModuleDict({"pearson": PearsonCorrCoef(), "mse": MeanSquaredError()})
        else:
            classes = self.model_config.num_labels
            self.val_metrics = torch.nn.ModuleDict(
                {"accuracy": MulticlassAccuracy(num_classes=classes, average="micro")}
            )

    def load_initial_weights(self) -> None:
        source = self.cfg.finetune.init_from
        if source is None:
            logger.warning("finetune.init_from is null: fine-tuning starts from random weights")
            return
        load_encoder_weights(self.model, read_pretrained_weights(source), source)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # The loss is the mean over the micro-batch's sequences, and every rank's micro-batch holds as many sequences
        # as every other's (EpochBatchSampler gives the ranks equal shares, cut into batches of micro_batch_size), so
        # the ranks' gradient average already weighs every sequence alike: the data-parallel weight would be 1.
        loss = self.model(**batch).loss
        self.log_training_loss(loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        output = self.model(**batch)
        labels = batch["labels"]
        self.val_loss.update(output.loss.detach(), weight=labels.shape[0])
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True)
        if self.model_config.problem_type == "regression":
            prediction, target = output.logits.float().reshape(-1), labels.float().reshape(-1)
        else:
            prediction, target = output.logits.float(), labels.reshape(-1).long()
        for name, metric in self.val_metrics.items():
            metric.update(prediction, target)
            self.log(f"val_{name}", metric, on_step=False, on_epoch=True)


def module_for(cfg: DictConfig) -> EncodonModule:
    return EncodonPretrainModule(cfg) if is_pretraining(cfg) else EncodonFinetuneModule(cfg)


def config_from_checkpoint(checkpoint: dict) -> NVEncodonConfig:
    """The model config a checkpoint of this recipe was trained with (``on_save_checkpoint``)."""
    return NVEncodonConfig(**checkpoint["model_config"])
