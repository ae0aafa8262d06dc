"""The Hugging Face ``Trainer``, told what it cannot know about this recipe: where the batches come from, the
learning-rate schedule, and the masked-LM loss over several micro-batches.

- Batches: ``dataset.create_dataloader`` (the same data handling as recipes/esm2_native_te) already reads a
  different share of the data on each process, packs THD batches and resumes exactly from its ``state_dict``. The
  Trainer gets it as it is (``get_train_dataloader``): handing it to ``accelerator.prepare`` would shard it a second
  time. The loader never ends; ``max_steps`` ends the run.
- Schedule: scheduler.py's warmup then linear decay to a floor (``create_scheduler``), as the native recipe.
- Loss: :func:`masked_lm_loss`, the Trainer's ``compute_loss_func``: the summed cross-entropy of a micro-batch over
  the masked tokens of the whole optimizer step (all micro-batches, all processes), so ``grad_acc_steps`` micro-batches
  give the gradient of one batch holding all of them, whatever number of tokens the masking picked in each.
- Weight decay: on the weight matrices and embedding tables, none on biases and LayerNorm weights
  (``get_decay_parameter_names``, weight_decay.py's rule by tensor dimension). The Trainer's own rule goes by name and
  leaves out every parameter whose name contains "layernorm": TE's ``layernorm_qkv.weight`` and
  ``layernorm_mlp.fc1_weight``/``fc2_weight``, most of a layer's weight matrices, which the stock Hugging Face model
  decays.
- Resume: AdamW's moments and the schedule's step come from the checkpoint, the optimizer's settings and the peak lr
  from this launch's config (``_load_optimizer_and_scheduler``, optimizer_settings.py).
- FP8 with DelayedScaling: before the first micro-batch of a launch trains, forward/backward passes on it set every
  FP8 scale (fp8_calibration.py: otherwise the first steps' gradients are cast with scales of 1); their gradients are
  discarded.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.utils import AutocastKwargs
from checkpoints import clear_for_save
from fp8_calibration import calibrate_delayed_scaling
from optimizer_settings import configured_settings, restore_configured_settings
from perf_logger import PerfLogger
from scheduler import get_linear_schedule_with_warmup
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from user_errors import ConfigError
from weight_decay import log_weight_decay_groups, no_weight_decay_names


IGNORE_INDEX = -100


def masked_lm_loss(
    outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Cross-entropy summed over the labelled tokens, divided by ``num_items_in_batch`` (the Trainer's count of
    labelled tokens in the optimizer step) or, without it, by this batch's own count."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return loss_sum / num_items_in_batch


class MaskedLMTrainer(Trainer):
    """``Trainer`` over this recipe's endless, resumable dataloader, with its schedule and per-step perf counters.

    Args:
        train_dataloader: from ``dataset.create_dataloader`` for this process's data-parallel rank.
        lr_scheduler_kwargs: ``num_warmup_steps``, ``num_decay_steps``, ``min_lr_ratio`` (scheduler.py).
        perf: counts each micro-batch's tokens and the step's loss; ``PerfCallback`` logs them.
        autocast: let accelerate run the forward under ``torch.autocast`` for bf16 (its default). False where the
            model computes in bf16 without it (FSDP2's MixedPrecisionPolicy casts the weights of each layer).
        calibrate_fp8_scales: the model's FP8 layers use DelayedScaling and ``calibrate_delayed_scaling`` is on.
    """

    def __init__(
        self,
        *args,
        train_dataloader,
        lr_scheduler_kwargs: dict,
        perf: PerfLogger,
        autocast: bool = True,
        calibrate_fp8_scales: bool = False,
        **kwargs,
    ):
        self.autocast = autocast  # read while super().__init__ builds the Accelerator
        super().__init__(*args, compute_loss_func=masked_lm_loss, **kwargs)
        self.recipe_dataloader = train_dataloader
        self.recipe_lr_scheduler_kwargs = dict(lr_scheduler_kwargs)
        self.perf = perf
        self.step_loss: torch.Tensor | None = None  # this optimizer step's loss so far, on the device
        self._flops_per_token: int | None = None
        self.calibrate_fp8_scales = calibrate_fp8_scales  # before this launch's first micro-batch trains

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        if not self.autocast:
            args["kwargs_handlers"] = [*args.get("kwargs_handlers", []), AutocastKwargs(enabled=False)]
        return args

    def get_train_dataloader(self):
        return self.recipe_dataloader

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer's prefetch of one optimizer step's micro-batches, moved to the device without waiting for it.

        The Trainer moves each batch with a blocking ``.to(device)``, which waits for the GPU to finish the previous
        step; so does its count of labelled tokens made on the host. Copying the (pinned) batches asynchronously first
        keeps the host launching work ahead of the GPU, as the native recipe does; the Trainer's own ``.to(device)``
        and count then happen on tensors already there.
        """
        batches = []
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            batches.append({k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()})
        return batches, self._get_num_items_in_batch(batches, device)

    def floating_point_ops(self, inputs) -> int:
        # The Trainer's total_flos statistic (not used by this recipe: perf_logger.py computes MFU) counts the
        # model's parameters for every micro-batch; count them once.
        if self._flops_per_token is None:
            self._flops_per_token = 6 * self.model.num_parameters(exclude_embeddings=True)
        return self._flops_per_token * inputs["input_ids"].numel()

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The parameters AdamW decays: every tensor of two or more dimensions (weight matrices, embeddings), as the
        stock model gets them by the Trainer's rule, whatever the backend calls them (weight_decay.py)."""
        no_decay = no_weight_decay_names(model)
        named = list(model.named_parameters())
        log_weight_decay_groups(
            model,
            self.args.weight_decay,
            [param.numel() for name, param in named if name not in no_decay],
            [param.numel() for name, param in named if name in no_decay],
        )
        return [name for name, _ in named if name not in no_decay]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            self.lr_scheduler = get_linear_schedule_with_warmup(
                optimizer or self.optimizer, **self.recipe_lr_scheduler_kwargs
            )
        return self.lr_scheduler

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.calibrate_fp8_scales:
            self.calibrate_fp8_scales = False
            # The Trainer's own forward and backward of this micro-batch (its loss weight, autocast, gradient sync).
            calibrate_delayed_scaling(
                self.model,
                forward_backward=lambda: super(MaskedLMTrainer, self).training_step(model, inputs, num_items_in_batch),
                zero_grad=lambda: model.zero_grad(set_to_none=True),
            )
        self.perf.count_batch(inputs)  # on the device already (get_batch_samples): the counters stay there
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss
        return loss

    def _save_checkpoint(self, model, trial):
        # The Trainer writes into checkpoint-<step> as it finds it. What an earlier save left there (a killed save,
        # with another run's marker or data position perhaps) goes first, so a save killed half-way never leaves an
        # old COMPLETE marker on new files (checkpoints.py).
        checkpoint = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.process_index == 0:
            clear_for_save(checkpoint)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no process writes its part before the directory is clear
        return super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # The checkpoint brings AdamW's moments and the schedule's step; lr, betas, eps, weight decay and the peak
        # lr stay this launch's config (optimizer_settings.py), so a resume with a lower adamw_kwargs.lr uses it.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper, if any
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        configured = configured_settings(optimizer, scheduler)
        try:
            self._load_saved_optimizer_and_scheduler(checkpoint)
        except ValueError as error:
            if "parameter group" not in str(error):
                raise
            # torch's "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            raise ConfigError(
                f"{checkpoint}: its AdamW state has other parameter groups than this recipe builds ({error}). "
                "Checkpoints written before the recipe grouped weight decay by tensor dimension (the Trainer's "
                "name rule left TE's QKV and MLP weights undecayed) resume with that earlier code only; "
                "start a new output_dir, or fine-tune from its exported model (init_from_pretrained)"
            ) from error
        restore_configured_settings(optimizer, scheduler, configured, str(checkpoint))

    def _load_saved_optimizer_and_scheduler(self, checkpoint):
        # A multi-process CPU run's device is "cpu:<rank>" (accelerate), which transformers passes to torch.load as
        # map_location, and torch.load knows only "cpu": resuming would fail. Restore onto the plain CPU device.
        device = self.args.device
        if device.type != "cpu" or device.index is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.args.__dict__["_setup_devices"] = torch.device("cpu")  # TrainingArguments caches its device here
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            self.args.__dict__["_setup_devices"] = device

    def take_step_loss(self) -> torch.Tensor:
        """This step's loss (its share of the global token mean on this process), and a fresh start for the next."""
        loss, self.step_loss = self.step_loss, None
        return loss
