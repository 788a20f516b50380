"""Per-GPU memory of a run before it starts: every kind of rank (pipeline stage x tensor rank) of a
layout, its model built on the meta device as the run builds it (`memory/meta_ranks.py`), frozen as
the trainer freezes it, with its state counted (`state_bytes.py`) and its activations measured
(`activation_bytes.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.config.objective_specs import objective_of
from megatron_ext.config.run_plan import RunPlan, native_vision
from megatron_ext.errors import UserError
from megatron_ext.memory.activation_bytes import (
    ActivationPieces,
    Recompute,
    lm_layers_bytes,
    measure,
    with_sequence_parallel,
)
from megatron_ext.memory.state_bytes import StateBytes, ddp_bucket_size, moments, state_bytes
from megatron_ext.model.arch import LlavaArch

GIB = 2**30
# Not counted above and not the run's to use: the CUDA context, NCCL's buffers, the allocator's
# fragmentation and cuBLAS/flash workspaces. A plan fits when this much of the GPU stays free.
RESERVE_FRACTION = 0.08


@dataclass(frozen=True)
class FitChoices:
    """What the plan depends on beyond the model: the choices a user changes to make a run fit."""

    tp: int
    pp: int
    dist_optim: bool
    recompute: Recompute
    sequence_parallel: bool
    # The objective's second, frozen model of the same parameters (DPO's live reference without LoRA).
    reference_copy: bool = False

    @classmethod
    def of(cls, plan: RunPlan) -> "FitChoices":
        ex, cfg = plan.execution.model, plan.config
        return cls(tp=cfg.tp, pp=cfg.pp, dist_optim=cfg.dist_optim,
                   recompute=Recompute(ex.recompute_granularity, ex.recompute_method, ex.recompute_num_layers),
                   sequence_parallel=ex.sequence_parallel,
                   reference_copy=objective_of(cfg).reference_copy(cfg))

    def with_layout(self, plan: RunPlan, tp: int, pp: int) -> "FitChoices":
        """At another layout, with sequence parallelism as the run decides it (on with TE from --tp 2)."""
        sp = plan.config.sequence_parallel
        if sp is None:
            sp = plan.execution.model.attention_backend == "te" and tp > 1 and not plan.config.eval_generate_samples
        return dataclasses.replace(self, tp=tp, pp=pp, sequence_parallel=sp)

    def data_parallel(self, plan: RunPlan) -> int:
        return plan.world_size // (self.tp * self.pp * plan.config.cp)


@dataclass(frozen=True)
class RankMemory:
    stage: int
    tp_ranks: tuple[int, ...]  # the tensor ranks of the stage that hold exactly this
    state: StateBytes
    lm_activations: int
    vision_activations: int
    in_flight: int  # micro batches whose activations the 1F1B schedule holds at once on this stage
    reference_bytes: int = 0  # --stage dpo: the frozen reference copy's parameters (live, without LoRA)

    @property
    def activations(self) -> int:
        return self.lm_activations + self.vision_activations

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.reference_bytes


@dataclass(frozen=True)
class MemoryPlan:
    choices: FitChoices
    dp: int
    ranks: tuple[RankMemory, ...]
    gpu_memory: int
    tokens: int  # LM tokens of one micro batch
    vision_inputs: int  # tiles / frames / images of one micro batch

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def usable(self) -> int:
        return int(self.gpu_memory * (1 - RESERVE_FRACTION))

    @property
    def fits(self) -> bool:
        return self.largest.total <= self.usable


def vision_inputs_per_sequence(plan: RunPlan) -> int:
    """Tower inputs one sequence may hold: --max-tiles-per-sequence, else one image (LLaVA-1.5
    unpacked), else as many as the sequence has room for (each takes at least its features' positions);
    a native-resolution model's: as many of its largest images as fill the sequence (`native_vision_bytes`)."""
    cfg = plan.config
    if not isinstance(plan.arch, LlavaArch):
        from megatron_ext.memory.native_vision_bytes import largest_images

        return largest_images(native_vision(plan), plan.seq_length).count
    if cfg.max_tiles_per_sequence:
        return cfg.max_tiles_per_sequence
    if plan.arch.tiling is None and not cfg.packing_seq_length:
        return 1
    return max(1, plan.seq_length // plan.arch.smallest_image_positions)


def _measure_execution(plan: RunPlan, choices: FitChoices):
    """The execution the meta models are built with: TE's layers as the sdpa ones (see
    activation_bytes), flash backends with core attention recomputed, no sequence parallelism
    (its split is derived from a second measurement)."""
    from megatron_ext.model.execution import ModelExecution

    local = plan.execution.model.attention_backend == "local"
    selective = not local or choices.recompute.granularity == "selective"
    return ModelExecution(attention_backend="local" if local else "sdpa",
                          recompute_granularity="selective" if selective else None)


def _options(plan: RunPlan, choices: FitChoices):
    from megatron_ext.model.provider import ModelOptions

    return ModelOptions(seq_length=plan.seq_length, dtype=plan.dtype, init_weights=False, parallel_output=True,
                        execution=_measure_execution(plan, choices))


def _measure(plan: RunPlan, choices: FitChoices, model) -> ActivationPieces:
    cfg = plan.config
    local = plan.execution.model.attention_backend == "local"
    lora_only = cfg.lora_rank > 0 and not cfg.lora_train_projector
    native = None if isinstance(plan.arch, LlavaArch) else native_vision(plan)
    return measure(model, plan.arch, plan.seq_length, flash_lse=not local and choices.recompute.granularity != "selective",
                   vision_flash=not local, input_grad=not lora_only, tower_trained=cfg.unfreeze_vit, native=native)


def _last_stage_at_tp_one(plan: RunPlan, choices: FitChoices) -> ActivationPieces:
    from megatron_ext.families import build_model
    from megatron_ext.memory.meta_ranks import as_rank
    from megatron_ext.train.model_setup import freeze_for_stage

    with as_rank(choices.pp - 1, 1, choices.pp):
        model = build_model(plan.arch, _options(plan, choices), meta=True)
        freeze_for_stage(model, plan)
        return _measure(plan, choices, model)


def _rank_memory(plan: RunPlan, choices: FitChoices, model, m: ActivationPieces, stage: int, tp_rank: int, dp: int) -> RankMemory:
    cfg = plan.config
    micro_batch = cfg.micro_batch_size
    tokens = micro_batch * plan.seq_length
    layers = len(model.language_model.decoder.layers)
    lm = lm_layers_bytes(m, layers, tokens, choices.recompute) + micro_batch * m.lm_other
    tiles = micro_batch * vision_inputs_per_sequence(plan)
    vision = tiles * m.vision_tile
    in_flight = min(choices.pp - stage, plan.num_microbatches)
    bucket_size = ddp_bucket_size(plan.execution.overlap_grad_reduce, plan.execution.ddp_bucket_size, dp, stage)
    state = state_bytes(model, choices.dist_optim, dp, bucket_size, moments(cfg.optimizer, cfg.sgd_momentum))
    return RankMemory(stage=stage, tp_ranks=(tp_rank,), state=state, lm_activations=in_flight * lm,
                      vision_activations=in_flight * vision, in_flight=in_flight,
                      reference_bytes=state.param_bytes if choices.reference_copy else 0)


def memory_plan(plan: RunPlan, gpu_memory: int, choices: FitChoices | None = None) -> MemoryPlan:
    """The plan of `plan`'s run (or of it with other `choices`) against `gpu_memory` bytes per GPU."""
    from megatron_ext.memory.meta_ranks import rank_models
    from megatron_ext.train.model_setup import freeze_for_stage

    choices = choices or FitChoices.of(plan)
    dp = choices.data_parallel(plan)
    at_one = _last_stage_at_tp_one(plan, choices) if choices.sequence_parallel and choices.tp > 1 else None
    ranks: list[RankMemory] = []
    measured: dict[int, ActivationPieces] = {}
    for rank, model in rank_models(plan.arch, (choices.tp, choices.pp), _options(plan, choices)):
        stage, tp_rank = divmod(rank, choices.tp)
        freeze_for_stage(model, plan)
        if stage not in measured:
            m = _measure(plan, choices, model)
            measured[stage] = with_sequence_parallel(m, at_one, choices.tp) if at_one else m
        ranks.append(_rank_memory(plan, choices, model, measured[stage], stage, tp_rank, dp))
    return MemoryPlan(choices=choices, dp=dp, ranks=_grouped(ranks), gpu_memory=gpu_memory,
                      tokens=plan.config.micro_batch_size * plan.seq_length,
                      vision_inputs=plan.config.micro_batch_size * vision_inputs_per_sequence(plan))


def _grouped(ranks: list[RankMemory]) -> tuple[RankMemory, ...]:
    """Tensor ranks of a stage that hold the same bytes, as one kind of rank."""
    kinds: dict[tuple, RankMemory] = {}
    for r in ranks:
        key = (r.stage, r.state, r.lm_activations, r.vision_activations, r.reference_bytes)
        if key in kinds:
            kinds[key] = dataclasses.replace(kinds[key], tp_ranks=kinds[key].tp_ranks + r.tp_ranks)
        else:
            kinds[key] = r
    return tuple(kinds.values())


def gib(n: float) -> str:
    """GiB, or MiB below one GiB (small models: tests, the vision tower's share)."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _ranks_name(r: RankMemory, choices: FitChoices) -> str:
    first, last = r.tp_ranks[0], r.tp_ranks[-1]
    tp = f"tp rank {first}" if first == last else f"tp ranks {first}-{last}"
    return f"stage {r.stage + 1}/{choices.pp}, {tp}"


def plan_lines(mp: MemoryPlan, dtype: str) -> list[str]:
    """The plan as printed at launch: one line per kind of rank, then the budget."""
    k = mp.choices
    recompute = k.recompute.granularity or "none"
    lines = [f"memory plan per GPU: tp {k.tp} x pp {k.pp} x dp {mp.dp}{' (dist-optim)' if k.dist_optim else ''}, "
             f"{dtype}, micro batch of {mp.tokens} tokens and {mp.vision_inputs} vision input(s), "
             f"recompute {recompute}{', sequence parallel' if k.sequence_parallel else ''}"]
    for r in mp.ranks:
        s = r.state
        lines.append(f"  {_ranks_name(r, k)}: parameters {gib(s.param_bytes)} ({s.trained / 1e6:,.1f}M trained, "
                     f"{s.frozen / 1e6:,.1f}M frozen), gradients {gib(s.grad_bytes)}, optimizer {gib(s.optimizer_bytes)}, "
                     f"activations LM {gib(r.lm_activations)} + vision {gib(r.vision_activations)} "
                     f"({r.in_flight} micro batch(es) in flight)"
                     + (f", DPO reference model {gib(r.reference_bytes)}" if r.reference_bytes else "")
                     + f" = {gib(r.total)}")
    largest = mp.largest
    lines.append(f"  largest {gib(largest.total)} of --gpu-memory {gib(mp.gpu_memory)} "
                 f"({int(RESERVE_FRACTION * 100)}% kept for CUDA, NCCL and fragmentation): "
                 f"margin {gib(mp.usable - largest.total)}")
    return lines


def largest_part(r: RankMemory) -> tuple[str, int]:
    parts = {"parameters": r.state.param_bytes, "gradients": r.state.grad_bytes,
             "optimizer state": r.state.optimizer_bytes, "language-model activations": r.lm_activations,
             "vision-tower activations": r.vision_activations, "DPO reference model": r.reference_bytes}
    name = max(parts, key=parts.get)
    return name, parts[name]


def _alternatives(plan: RunPlan, choices: FitChoices) -> list[tuple[str, FitChoices]]:
    """What a user may change, cheapest first: recomputation, the distributed optimizer, then the layout."""
    out = []
    if choices.reference_copy:
        out.append(("--reference-logprobs precompute", dataclasses.replace(choices, reference_copy=False)))
    if choices.recompute.granularity is None and plan.execution.model.attention_backend == "local":
        out.append(("--recompute-granularity selective", dataclasses.replace(choices, recompute=Recompute("selective"))))
    if choices.recompute.granularity != "full":
        out.append(("--recompute-granularity full", dataclasses.replace(choices, recompute=Recompute("full"))))
    if not choices.dist_optim and choices.data_parallel(plan) > 1:
        out.append(("--dist-optim", dataclasses.replace(choices, dist_optim=True)))
    cp = plan.config.cp
    for tp, pp in ((choices.tp * 2, choices.pp), (choices.tp, choices.pp * 2)):
        if plan.world_size % (tp * pp * cp) == 0 and not plan.arch.parallel_problems(tp, pp):
            out.append((f"--tp {tp} --pp {pp}", choices.with_layout(plan, tp, pp)))
    return out


def refusal(plan: RunPlan, mp: MemoryPlan) -> str:
    """One line: what does not fit, its largest part, and what would fit (each alternative planned)."""
    largest = mp.largest
    name, size = largest_part(largest)
    fitting = []
    for flag, choices in _alternatives(plan, mp.choices):
        other = memory_plan(plan, mp.gpu_memory, choices)
        if other.fits:
            fitting.append(f"{flag} fits ({gib(other.largest.total)})")
    advice = ", or ".join(fitting) if fitting else "nothing tried fits (recomputation, --dist-optim, --tp/--pp x 2)"
    return (f"memory plan: {_ranks_name(largest, mp.choices)} needs {gib(largest.total)}, over the "
            f"{gib(mp.usable)} usable of --gpu-memory {gib(mp.gpu_memory)}; largest part: {name} {gib(size)} at "
            f"--seq-length {plan.seq_length}; {advice}; --no-memory-check launches anyway")



def published_shape_plan(hf_config: dict, config, world_size: int, te: bool = True, on_gpu: bool = True) -> RunPlan:
    """The RunPlan of a run of the model of `hf_config` (a LLaVA's or a vision-language family's
    config.json) with the TrainConfig `config` (bfloat16 on GPUs, float32 on CPUs), with no
    checkpoint, tokenizer or dataset: for planning published shapes (docs/gpu.md) from their configs."""
    from pathlib import Path

    from megatron_ext import families
    from megatron_ext.config.execution_choices import resolve_execution
    from megatron_ext.data.prepared import SplitCount

    config = config.resolved()
    hf_config = families.complete_config(hf_config)
    arch = families.read_model(hf_config)
    return RunPlan(config=config, arch=arch, families=families.of(arch), hf_config=hf_config, start=None, resume=None,
                   tokenizer_dir=Path("."), train_split=SplitCount(0), world_size=world_size,
                   dtype="bfloat16" if on_gpu else "float32",
                   execution=resolve_execution(config, world_size, te, on_gpu), skip_ranges=())


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """--layouts `4x2,8x1` -> [(4, 2), (8, 1)] (TP x PP)."""
    layouts = []
    for item in text.split(","):
        try:
            tp, pp = (int(x) for x in item.strip().split("x"))
        except ValueError:
            raise UserError(f"--layouts {text!r}: expected TPxPP items such as 4x2,8x1,2x4") from None
        if tp < 1 or pp < 1:
            raise UserError(f"--layouts {text!r}: {item} needs TP and PP of at least 1")
        layouts.append((tp, pp))
    return layouts


def layout_plans(plan: RunPlan, gpu_memory: int, layouts: list[tuple[int, int]]) -> list[MemoryPlan]:
    """The plan at each layout over the run's processes; a layout they cannot hold is one line."""
    base = FitChoices.of(plan)
    plans = []
    for tp, pp in layouts:
        if plan.world_size % (tp * pp * plan.config.cp):
            raise UserError(f"--layouts {tp}x{pp}: tp x pp = {tp * pp} does not divide the {plan.world_size} processes")
        problems = plan.arch.parallel_problems(tp, pp)
        if problems:
            raise UserError(f"--layouts {tp}x{pp}: " + "; ".join(problems))
        plans.append(memory_plan(plan, gpu_memory, base.with_layout(plan, tp, pp)))
    return plans


def side_by_side(plans: list[MemoryPlan]) -> list[str]:
    """One column per layout, each the layout's largest rank."""
    def column(mp: MemoryPlan) -> dict[str, str]:
        r, s = mp.largest, mp.largest.state
        return {"layout (tp x pp x dp)": f"{mp.choices.tp} x {mp.choices.pp} x {mp.dp}",
                "largest rank": _ranks_name(r, mp.choices).replace("tp ranks", "tp").replace("tp rank", "tp"),
                "parameters": gib(s.param_bytes), "trained parameters": f"{s.trained / 1e6:,.1f}M",
                "gradients": gib(s.grad_bytes), "optimizer": gib(s.optimizer_bytes),
                "activations LM": gib(r.lm_activations), "activations vision": gib(r.vision_activations),
                "total": gib(r.total), "margin": gib(mp.usable - r.total), "fits": "yes" if mp.fits else "NO"}

    columns = [column(mp) for mp in plans]
    names = list(columns[0])
    widths = [max(len(name) for name in names)] + [max(len(c[n]) for n in names) for c in columns]
    return ["  ".join([name.ljust(widths[0])] + [c[name].rjust(w) for c, w in zip(columns, widths[1:])])
            for name in names]
