"""The model, its DDP wrapper, optimizer and LR schedule, all from megatron-core."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from dataclasses import dataclass

import torch

from megatron_ext.compat import wgrad_accumulation
from megatron_ext.config.run_plan import RunPlan
from megatron_ext.families import build_model
from megatron_ext.lora.layers import add_lora
from megatron_ext.lora.settings import lora_settings
from megatron_ext.model.provider import DTYPES, ModelOptions
from megatron_ext.train import fused_adam

log = logging.getLogger(__name__)


@dataclass
class TrainingModel:
    model: torch.nn.Module  # the LLaVAModel itself (checkpoints use its sharded_state_dict)
    ddp: torch.nn.Module  # what forward/backward runs: DDP(Float16Module?(model))
    optimizer: object
    scheduler: object

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @contextlib.contextmanager
    def parameters_gathered(self):
        """Every parameter current, for saving or evaluating. With --dist-optim and an overlapped
        all-gather, a rank holds only its own updated shard after a step until the next training
        forward pass gathers the rest module by module."""
        if not getattr(self.ddp, "use_forward_hook", False):
            yield
            return
        self.ddp.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            self.ddp.enable_forward_pre_hook()


def freeze_for_stage(model, plan: RunPlan) -> None:
    """Stage 1 trains the projector; stage 2 the projector and the LM; the ViT only with --unfreeze-vit.
    A tiled LLaVA's `image_newline` trains with the projector. With --lora-rank, the adapters (and
    the projector with --lora-train-projector) and nothing else."""
    cfg = plan.config
    lora = lora_settings(cfg)
    if lora is not None:
        wrapped = add_lora(model, lora, seed=cfg.seed)
        log.info("LoRA rank %d on %d layers of this rank", lora.rank, len(wrapped))
        return
    model.freeze(freeze_language_model=cfg.freeze_lm, freeze_vision_model=not cfg.unfreeze_vit,
                 freeze_vision_projection=False)
    # megatron-core's freeze() knows only its own modules; the newline is part of the projection.
    if getattr(model, "image_newline", None) is not None:
        model.image_newline.requires_grad_(True)


def lr_overrides(config, plan: RunPlan) -> dict | None:
    """megatron-core's per-parameter-group settings: its standard ones (no weight decay on biases
    and norms), and with --vision-lr the vision tower's own peak learning rate."""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    cfg = plan.config
    overrides = get_standard_config_overrides(config)
    if cfg.vision_lr is not None:
        tower = ParamWithNamePredicate(name="vision_tower", fn=_in_vision_tower)
        overrides[ParamKey(with_name_predicate=tower)] = {"max_lr": cfg.vision_lr, "min_lr": min(cfg.min_lr, cfg.vision_lr)}
    return overrides


def _in_vision_tower(param, name: str) -> bool:
    """The vision model's parameters but a projection inside it (Qwen2.5-VL's merger, marked by
    `model.mrope_vlm`), which trains at the projector's learning rate."""
    return fnmatch.fnmatch(name, "*vision_model.*") and not getattr(param, "is_vision_projection", False)


def schedule_steps(plan: RunPlan) -> int:
    """The LR schedule's length: iterations, or samples where a run's length is samples (`epoch_samples`)."""
    return plan.epoch_samples or plan.train_iters


def warmup_steps(plan: RunPlan) -> int:
    """Steps of linear warm-up: --lr-warmup-fraction of the schedule, rounded down."""
    return int(plan.config.lr_warmup_fraction * schedule_steps(plan))


def trained_model(plan: RunPlan):
    """This rank's LLaVAModel as the run trains it, before megatron's wrappers: initialised where the
    run starts from no checkpoint, frozen for its stage."""
    model = build_model(plan.arch, ModelOptions.for_run(plan, init_weights=plan.start is None and plan.resume is None))
    freeze_for_stage(model, plan)
    return model


def build_training_model(plan: RunPlan) -> TrainingModel:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    cfg = plan.config
    model = trained_model(plan)
    if plan.execution.model.gradient_accumulation_fusion:
        wgrad_accumulation.require_kernel()
    config = model.config
    # Token-weighted loss across micro batches and data-parallel ranks; must precede the DDP wrapper.
    config.calculate_per_token_loss = True
    wrapped = Float16Module(config, model) if plan.dtype == "bfloat16" else model
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.dist_optim,
            overlap_grad_reduce=plan.execution.overlap_grad_reduce,
            overlap_param_gather=plan.execution.overlap_param_gather, bucket_size=plan.execution.ddp_bucket_size,
        ),
        module=wrapped,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync

    # Every rank gets an optimizer, also a pipeline stage whose layers are all frozen: megatron
    # reduces gradient statistics over the model-parallel group inside optimizer.step().
    optimizer_config = OptimizerConfig(
        optimizer=cfg.optimizer, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, sgd_momentum=cfg.sgd_momentum,
        clip_grad=cfg.clip_grad, bf16=plan.dtype == "bfloat16", params_dtype=DTYPES[plan.dtype],
        use_distributed_optimizer=cfg.dist_optim, overlap_param_gather=plan.execution.overlap_param_gather,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [ddp], config_overrides=lr_overrides(optimizer_config, plan))
    fused_adam.use(optimizer, cfg.fused_adam)
    config.grad_scale_func = optimizer.scale_loss
    warmup = warmup_steps(plan)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=schedule_steps(plan), lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=schedule_steps(plan),
        wd_incr_style="constant",
    )
    trained = TrainingModel(model, ddp, optimizer, scheduler)
    log.info("model built: %d parameters on this rank, %d trainable (stage %s%s)",
             sum(p.numel() for p in model.parameters()), trained.trainable_parameters(), cfg.stage,
             ", LM frozen" if cfg.freeze_lm or cfg.lora_rank else "")
    return trained
