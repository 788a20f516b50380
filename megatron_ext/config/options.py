"""Every trainer option, declared once.

`TrainConfig` is the trainer's resolved configuration (printed at start, stored in every
checkpoint). The trainer's command line is generated from its fields, and the launcher
(`scripts/train/run.py`) passes its flags through by the same names, so the two cannot drift.
This module imports no torch: the launcher's --dry-run must stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_ext.data.image_aspects import IMAGE_ASPECTS
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES
from megatron_ext.model.backends import ATTENTION_BACKENDS, COMPUTE_DTYPES, FP8_BACKENDS


def opt(default, help: str, **extra):
    """A config field with its --help text (and click extras such as `choices`)."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, **extra}, **factory)


# LLaVA-1.5's recipes: stage 1 = projector pre-training, stage 2 = visual instruction tuning; then
# preference tuning (RLAIF-V's and LLaVA-OneVision's DPO runs: global batch 64, lr 5e-7).
STAGE_DEFAULTS = {
    1: {"global_batch_size": 256, "lr": 1e-3, "freeze_lm": True},
    2: {"global_batch_size": 128, "lr": 2e-5, "freeze_lm": False},
    "dpo": {"global_batch_size": 64, "lr": 5e-7, "freeze_lm": False},
}
DPO_LOSSES = ("sigmoid", "ipo", "robust")


@dataclass
class TrainConfig:
    # --- model and checkpoints -------------------------------------------------------------
    megatron_load_dir: str | None = opt(None, "Checkpoint to start from (converted or trained, any saved TP/PP).")
    tokenizer_load_dir: str | None = opt(None, "HF directory with tokenizer + processor (default: the checkpoint's copy).")
    init: bool = opt(False, "Initialise weights randomly (architecture from the load dir or the tokenizer dir's config.json).")
    save: bool = opt(False, "Save checkpoints to --save-dir.")
    save_dir: str | None = opt(None, "Checkpoint directory; re-running with the same directory resumes from its latest checkpoint.")
    save_interval: int | None = opt(None, "Save every N iterations (and always at the end).")
    save_optim: bool = opt(False, "Include optimizer state in checkpoints.")
    load_optim: bool | None = opt(None, "Load the optimizer state when resuming (default: whenever the checkpoint "
                                        "holds it; --no-load-optim starts Adam's moments afresh).")
    keep_last: int = opt(3, "Keep the newest K checkpoints (0 keeps all).")
    exit_interval: int | None = opt(None, "Save and exit after iteration N.")
    # --- parallelism -----------------------------------------------------------------------
    tp: int = opt(1, "Tensor model parallel size.")
    pp: int = opt(1, "Pipeline model parallel size.")
    dist_optim: bool = opt(False, "Shard optimizer state across data-parallel ranks.")
    distributed_backend: str | None = opt(None, "torch.distributed backend (default: nccl on GPU, gloo on CPU).",
                                          choices=["nccl", "gloo", "mpi"])
    cp: int = opt(1, "Context parallel size: each sequence is split over this many GPUs (Transformer Engine; "
                     "--micro-batch-size 1).")
    sequence_parallel: bool | None = opt(None, "Sequence parallelism over the --tp group (Transformer Engine); "
                                               "default: on with Transformer Engine when --tp > 1, unless "
                                               "--eval-generate-samples (generation runs without it).")
    overlap_grad_reduce: bool | None = opt(None, "Overlap the data-parallel gradient reduction with the backward "
                                                 "pass (default: on).")
    overlap_param_gather: bool | None = opt(None, "Overlap the parameter all-gather of --dist-optim with the next "
                                                  "forward pass (default: on with --dist-optim).")
    ddp_bucket_size: int | None = opt(None, "Gradient reduction bucket size in parameters (default: megatron-core's, "
                                            "max(40M, 1M x data-parallel size)).")
    # --- attention and memory -------------------------------------------------------------
    attention_backend: str = opt("auto", "Layer and attention implementation: te (Transformer Engine), sdpa "
                                         "(torch scaled_dot_product_attention: flash kernels without TE), local "
                                         "(megatron's reference kernel); auto: te where it is importable with CUDA, "
                                         "else sdpa.", choices=["auto", *ATTENTION_BACKENDS])
    recompute_granularity: str = opt("auto", "Activation recomputation in the backward pass: selective (core "
                                             "attention), full (whole layers) or none; auto: selective with the local "
                                             "kernel (its S x S scores), none with sdpa and te (flash kernels keep "
                                             "no scores).", choices=["auto", "none", "selective", "full"])
    logits_where_loss: bool | None = opt(None, "Compute the output layer's logits and the cross entropy only at the "
                                               "positions a loss is taken at (the same losses and gradients; default: "
                                               "on, except with sequence or context parallelism); "
                                               "--no-logits-where-loss: at every position, as megatron-core does.")
    compile_layers: bool | None = opt(None, "Compile each transformer layer (language model and vision tower) "
                                            "with torch.compile: fused elementwise kernels and less Python per layer; "
                                            "the first steps are slower while it compiles (default: on with a CUDA GPU "
                                            "and --attention-backend sdpa at --tp 1, 1.6x the eager step on an H200; "
                                            "docs/gpu.md; at --tp > 1 only when asked for, not measured yet). Only "
                                            "with --attention-backend sdpa.")
    gradient_accumulation_fusion: bool | None = opt(None, "Add each weight gradient into the fp32 gradient buffer "
                                                          "within its GEMM (megatron-core's gradient accumulation "
                                                          "fusion): no bf16 gradient and no separate add per matrix "
                                                          "per micro batch. Default: on with a CUDA GPU where Apex or "
                                                          "Transformer Engine provides the kernel; "
                                                          "--gradient-accumulation-fusion uses torch's own GEMM "
                                                          "where they are missing (not yet measured on a GPU).")
    recompute_method: str = opt("uniform", "Full recomputation: uniform (groups of --recompute-num-layers layers) or "
                                           "block (the first --recompute-num-layers layers of each pipeline stage).",
                                choices=["uniform", "block"])
    recompute_num_layers: int = opt(1, "Layers per recomputed group (uniform) or recomputed layers per stage (block).")
    # --- batches and schedule --------------------------------------------------------------
    micro_batch_size: int = opt(1, "Samples (packed sequences) per micro batch per data-parallel rank.")
    global_batch_size: int | None = opt(None, "Samples (DPO: pairs) per optimizer step (stage default: 256 / 128 / 64).")
    train_iters: int | None = opt(None, "Optimizer steps to train (default: one epoch of the training split).")
    epochs: float | None = opt(None, "Train length in passes over the training split (instead of --train-iters).")
    lr: float | None = opt(None, "Peak learning rate (stage default: 1e-3 / 2e-5 / 5e-7).")
    min_lr: float = opt(0.0, "Learning rate at the end of the decay.")
    lr_warmup_fraction: float = opt(0.03, "Fraction of the steps spent in linear warm-up.")
    lr_decay_style: str = opt("cosine", "Learning-rate decay.", choices=["cosine", "linear", "constant"])
    optimizer: str = opt("adam", "adam (AdamW: decoupled weight decay) or sgd (torch.optim.SGD: weight decay added "
                                 "to the gradient, --sgd-momentum).", choices=["adam", "sgd"])
    fused_adam: bool = opt(False, "AdamW as torch's fused kernel (one pass per parameter group) instead of its "
                                  "default foreach kernels, where megatron-core builds torch's AdamW (without "
                                  "Transformer Engine or Apex, whose FusedAdam it uses otherwise). Not yet measured "
                                  "on a GPU.")
    weight_decay: float = opt(0.0, "Weight decay (not on biases and norms).")
    clip_grad: float = opt(1.0, "Gradient clipping by global norm (0 disables).")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.999, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    sgd_momentum: float = opt(0.9, "SGD momentum (--optimizer sgd; 0: plain SGD).")
    seed: int = opt(1234, "Random seed.")
    skip_train_iteration_range: list[str] = opt(list, "Iterations START-END whose data is consumed without an update (repeatable).")
    max_nonfinite_steps: int = opt(10, "Stop after this many consecutive non-finite losses.")
    # --- stage -----------------------------------------------------------------------------
    stage: int | str = opt(1, "1: train the projector (LM and ViT frozen); 2: train projector + LM (ViT frozen); dpo: "
                              "preference tuning of projector + LM on pairs (--megatron-load-dir is also the frozen "
                              "reference).", choices=["1", "2", "dpo"])
    freeze_lm: bool = opt(False, "Freeze the language model (implied by --stage 1).")
    unfreeze_vit: bool = opt(False, "Also train the vision tower.")
    vision_lr: float | None = opt(None, "With --unfreeze-vit: the vision tower's peak learning rate (default: --lr), "
                                        "decayed on the same schedule (LLaVA-OneVision trains its tower at 2e-6).")
    # --- preference tuning (--stage dpo) ---------------------------------------------------
    dpo_beta: float = opt(0.1, "DPO's beta: how far the policy may move from the reference.")
    dpo_loss: str = opt("sigmoid", "DPO loss: sigmoid (DPO), ipo (IPO, per-token log-ratios) or robust (Robust DPO, "
                                   "with --dpo-label-smoothing as the label flip rate).", choices=list(DPO_LOSSES))
    dpo_label_smoothing: float = opt(0.0, "With --dpo-loss robust: the rate at which preference labels are flipped.")
    rpo_alpha: float | None = opt(None, "Also train on the chosen answer: alpha x its NLL per token (RPO).")
    reference_logprobs: str = opt("live", "DPO's reference log-probabilities: live (a frozen copy of the starting "
                                          "model runs beside the trained one; with LoRA the adapters are switched "
                                          "off instead) or precompute (one forward pass over the train split "
                                          "before training, kept in SAVE_DIR/reference_logps.json: one model "
                                          "in memory).", choices=["live", "precompute"])
    # --- LoRA ------------------------------------------------------------------------------
    lora_rank: int = opt(0, "LoRA adapter rank (0: no LoRA). Stage 2: the language model is frozen and adapters on "
                            "--lora-targets are trained; checkpoints then hold the adapters (and the projector with "
                            "--lora-train-projector) and name the base checkpoint they apply to.")
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapters' output is scaled by alpha / rank.")
    lora_dropout: float = opt(0.0, "Dropout on the adapters' input.")
    lora_targets: str = opt("qkv,proj,fc1,fc2", "Language-model linear layers that get adapters, comma-separated: qkv "
                                                "(fused Q/K/V), proj (attention output), fc1 (gate/up), fc2 (down).")
    lora_train_projector: bool = opt(False, "With --lora-rank, also train the projector in full (LLaVA's LoRA recipe).")
    # --- data ------------------------------------------------------------------------------
    data_path: str | None = opt(None, "Prepared energon dataset directory or metadataset YAML (blend).")
    seq_length: int | None = opt(None, "Language-model sequence length incl. image embeddings (default: min(2048, model max)).")
    packing_seq_length: int | None = opt(None, "Pack several samples into sequences of this length.")
    max_tiles_per_sequence: int | None = opt(None, "Most vision tower inputs (tiles, video frames; LLaVA-1.5: "
                                                   "images) in one sequence: a sample with more is skipped and "
                                                   "counted, packing closes a pack before it would pass the bound; a "
                                                   "micro batch then holds at most --micro-batch-size x N.")
    video_frames: int = opt(DEFAULT_VIDEO_FRAMES, "Frames sampled uniformly (first and last included) from each video "
                                                  "of a tiled model with videos (LLaVA-OneVision; 32 as its training "
                                                  "recipes' frames_upbound).")
    max_pixels: int | None = opt(None, "Native-resolution models (Qwen2.5-VL, Qwen3-VL): the most pixels the processor "
                                       "resizes an image to, as transformers' max_pixels (default: the checkpoint's "
                                       "processor's, else the family's 1,003,520); no video frame gets more either. "
                                       "The memory plan counts the tower's largest image from it.")
    min_pixels: int | None = opt(None, "Native-resolution models: the fewest pixels the processor resizes an image to, "
                                       "as transformers' min_pixels (default: the checkpoint's processor's, else the "
                                       "family's 3,136).")
    vision_attention: str = opt("sdpa", "Native-resolution models: the vision tower's attention. sdpa: transformers' "
                                        "own, one call per image (and per window in Qwen2.5-VL's windowed layers); "
                                        "varlen: one call per layer over all of them, torch's flash kernel on a GPU in "
                                        "bf16/fp16 (one masked SDPA call elsewhere), and blocks --compile-layers "
                                        "compiles. Equal features; the default stays sdpa until a GPU measures "
                                        "both (BENCHMARKS.md).",
                                choices=["sdpa", "varlen"])
    num_workers: int = opt(2, "Data loader worker processes per rank.")
    lang: str = opt("en", "Main language; selects the default chat template.", choices=["en", "ja", "jp"])
    chat_template: str | None = opt(None, "Chat template: 'tokenizer' or a name from megatron_ext/data/chat_templates.")
    image_aspect: str = opt("crop", "Images of another shape than the vision tower's: crop (the processor's resize "
                                    "+ center crop), pad (LLaVA-1.5: pad to a square with the mean colour, then "
                                    "resize) or resize (squash). Stored with the checkpoint; generation and "
                                    "evaluation use it.", choices=IMAGE_ASPECTS)
    image_token_id: int | None = opt(None, "Image token id (default: from the tokenizer).")
    pad_token_id: int | None = opt(None, "Padding token id (default: from the tokenizer).")
    no_add_class_token: bool = opt(False, "Do not pass the vision class token to the language model.")
    # --- precision -------------------------------------------------------------------------
    dtype: str = opt("auto", "Compute dtype (auto: bfloat16 on GPU, float32 on CPU).", choices=["auto", *COMPUTE_DTYPES])
    fp8: bool = opt(False, "FP8 in the language model's layers (recipe: --fp8-backend's).")
    fp8_backend: str = opt("te", "What runs --fp8: te (Transformer Engine's layers, hybrid recipe) or torchao "
                                 "(torchao's float8 training on the language model's trained linear layers, dynamic "
                                 "tensorwise scales; without TE: --tp 1, megatron-core's local layers; pip install "
                                 "'megatron-ext[fp8]').", choices=list(FP8_BACKENDS))
    # --- logging and evaluation ------------------------------------------------------------
    name: str | None = opt(None, "Run name (logs, W&B).")
    log_interval: int = opt(1, "Log every N iterations.")
    wandb: bool = opt(False, "Log to Weights & Biases (offline when WANDB_MODE=offline).")
    wandb_project: str = opt("megatron-ext", "W&B project.")
    eval_interval: int | None = opt(None, "Validation loss every N iterations.")
    eval_iters: int = opt(10, "Validation batches per evaluation.")
    eval_on_start: bool = opt(False, "Also evaluate before training (logged as iteration 0): the starting weights' "
                                     "scores to compare with. A resumed run does not repeat it.")
    eval_generate_samples: int = opt(0, "At every evaluation also answer the first N val samples greedily and log "
                                        "exact match, BLEU, ROUGE-L and CIDEr.")
    eval_max_new_tokens: int = opt(32, "Most tokens per answer in those evaluations.")
    eval_benchmarks: str | None = opt(None, "At every evaluation also score these lmms-eval tasks (comma-separated, "
                                            "e.g. textvqa_val; needs the eval extra) and log their scores.")
    eval_benchmark_limit: int = opt(200, "Samples per lmms-eval task in those evaluations.")
    eval_benchmark_include_path: str | None = opt(None, "Directory of extra lmms-eval task YAMLs (local datasets).")
    # --- debugging -------------------------------------------------------------------------
    debug: bool = opt(False, "Verbose logging.")
    deterministic: bool = opt(False, "Deterministic algorithms (slower).")

    def __post_init__(self):
        # The command line gives every stage as text; stages 1 and 2 are numbers.
        if self.stage in ("1", "2"):
            self.stage = int(self.stage)

    def resolved(self) -> "TrainConfig":
        """A copy with the stage's defaults filled in for everything left unset."""
        defaults = STAGE_DEFAULTS[self.stage]
        changes = {k: v for k, v in defaults.items() if k != "freeze_lm" and getattr(self, k) is None}
        if defaults["freeze_lm"]:
            changes["freeze_lm"] = True
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def is_switch(field: dataclasses.Field) -> bool:
    """A `bool | None` option: None means "decided from the other options", so it has an --x/--no-x pair."""
    return field.type in ("bool | None", bool | None)


def to_argv(values: dict) -> list[str]:
    """Trainer command-line arguments for the given field values (unset / False ones omitted, except
    an explicit False of a switch, which is its --no-x form)."""
    argv: list[str] = []
    by_name = {f.name: f for f in fields()}
    for name, value in values.items():
        if name not in by_name:
            raise KeyError(f"unknown trainer option {name}")
        if value is None or value == [] or (value is False and not is_switch(by_name[name])):
            continue
        flag = option_name(name)
        if value is False:
            argv.append("--no-" + flag[2:])
        elif value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv
