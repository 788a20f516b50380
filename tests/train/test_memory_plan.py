"""The memory plan (megatron_ext/memory/plan.py) against a real run's model on the CPU.

Parameters, gradient buffers and optimizer state must be the bytes the trainer's own model,
megatron-core's DDP buffers and its Adam hold, exactly; the activation terms within 10% of what
autograd saves in a real forward of the whole model (and, with full recomputation, the backward's
reruns): each backend and recompute setting, each rank at TP2 with and without sequence
parallelism, a tiled OneVision.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from megatron_ext.config.options import TrainConfig
from megatron_ext.model.tiling import IMAGE, VIDEO, Media
from tests.shapes import SHAPES, narrowed
from tests.train.saved_parts import cut_below_the_layers, saved_in_forward

GIB = 2**30
SMALL_LLAVA = narrowed(json.loads((SHAPES / "llava" / "llava-hf--llava-1.5-7b-hf.json").read_text()))


def cpu_plan(**options):
    from megatron_ext.memory.plan import published_shape_plan

    config = TrainConfig(train_iters=1, global_batch_size=1, seq_length=options.pop("seq_length", 256), **options)
    return published_shape_plan(SMALL_LLAVA, config, world_size=1, te=False, on_gpu=False)


def real_state(plan) -> tuple[int, int, int]:
    """(parameter, gradient buffer, optimizer state) bytes of the trainer's model for `plan`, after one
    Adam step (its moments exist from then), in a process group of one."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext.compat import cpu_support
    from megatron_ext.train.held_state import held_state_bytes
    from megatron_ext.train.model_setup import build_training_model

    cpu_support.apply()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        trained = build_training_model(plan)
        trained.ddp.zero_grad_buffer()
        trained.optimizer.step()
        return held_state_bytes(trained)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


CASES = {
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2),
    "stage 2, vision tower trained": dict(stage=2, unfreeze_vit=True),
    "LoRA": dict(stage=2, lora_rank=4, lora_train_projector=True),
}


@pytest.mark.multiprocess  # a gloo process group of one, in this process
@pytest.mark.timeout(240)
def test_state_bytes_equal_a_real_runs_model_buffers_and_optimizer():
    from megatron_ext.memory.plan import memory_plan

    for name, options in CASES.items():
        plan = cpu_plan(**options)
        (rank,) = memory_plan(plan, 80 * GIB).ranks
        s = rank.state
        assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == real_state(plan), name
        assert s.trained > 0 and (s.frozen > 0) == (name != "stage 2, vision tower trained"), name


def test_a_plan_over_budget_is_refused_in_one_line_naming_its_largest_part_and_what_fits():
    from megatron_ext.memory.plan import gib, largest_part, memory_plan, refusal

    plan = cpu_plan(stage=2, seq_length=2048, attention_backend="local", recompute_granularity="none")
    full = memory_plan(plan, 80 * GIB)
    rank = full.largest
    name, size = largest_part(rank)
    assert name == "language-model activations" and size == rank.lm_activations > rank.state.total
    # A GPU just too small for this, large enough once layers are recomputed.
    budget = int(rank.total / 0.92) - 1
    over = memory_plan(plan, budget)
    assert not over.fits
    line = refusal(plan, over)
    assert "\n" not in line
    assert line.startswith(f"memory plan: stage 1/1, tp rank 0 needs {gib(rank.total)}")
    assert f"largest part: language-model activations {gib(size)} at --seq-length 2048" in line
    assert "--recompute-granularity selective fits" in line and "--recompute-granularity full fits" in line
    selective = memory_plan(plan, budget, dataclasses_replace_recompute(over.choices, "selective"))
    assert selective.fits and selective.largest.lm_activations < rank.lm_activations / 2


def dataclasses_replace_recompute(choices, granularity):
    import dataclasses

    from megatron_ext.memory.activation_bytes import Recompute

    return dataclasses.replace(choices, recompute=Recompute(granularity))


# The small 7B with a vocabulary of 4096 (image and pad tokens moved into it): the published one's
# logits would outweigh the layers 5 to 1 at this width, and the layers are what is checked here.
ACTIVATION_LLAVA = copy.deepcopy(SMALL_LLAVA)
ACTIVATION_LLAVA.update(vocab_size=4096, image_token_index=4000, pad_token_id=4001)
ACTIVATION_LLAVA["text_config"]["vocab_size"] = 4096
# Recompute settings by name: their options, and the layers that full recomputation reruns together
# (uniform: --recompute-num-layers per group; block: the first --recompute-num-layers one by one).
RECOMPUTE = {"none": (dict(recompute_granularity="none"), 0),
             "selective": (dict(recompute_granularity="selective"), 0),
             "full": (dict(recompute_granularity="full"), 1),
             "full, groups of 2": (dict(recompute_granularity="full", recompute_num_layers=2), 2),
             "full, block of 1": (dict(recompute_granularity="full", recompute_method="block"), 1)}
# (backend, recompute, sequence length, images of 576 positions), the tower trained so it keeps
# activations: two lengths x two image counts with sdpa (a flash kernel's tensors); local's S x S
# scores without recomputation and with selective recomputation (local's default) at a short length;
# selective and full recomputation of sdpa's layers at two lengths and two image counts (paired: the
# image count changes the tower, which takes no recompute setting), full's other methods at one.
ACTIVATION_CASES = [("sdpa", "none", seq, images) for seq in (1280, 2560) for images in (1, 2)] + [
    ("local", "none", 640, 1), ("local", "selective", 640, 1)] + [
    ("sdpa", recompute, seq, images) for recompute in ("selective", "full") for seq, images in ((640, 1), (1280, 2))] + [
    ("sdpa", "full, groups of 2", 640, 1), ("sdpa", "full, block of 1", 640, 1)]


@pytest.fixture(scope="module")
def activations_planned_and_saved():
    """{case: (the plan's rank, vision bytes, LM bytes) kept by a real CPU forward}: one model the
    trainer builds per backend and recompute setting (fp32, TP1), its forwards on real tensors.

    What the plan models is the most that backward holds at once. Without full recomputation that is
    what the forward saves. With it the forward saves each group's input (megatron's checkpoints) and
    the activations of the layers not recomputed (block), and backward reruns one group at a time,
    which then holds its layers' activations: the LM bytes are the forward's plus the most that one
    group saves when backward recomputes it, measured in a real backward."""
    from megatron_ext.compat import cpu_support
    from megatron_ext.memory.meta_ranks import as_rank
    from megatron_ext.memory.plan import memory_plan, published_shape_plan
    from megatron_ext.train.model_setup import trained_model

    cpu_support.apply()  # megatron's recomputation in backward asks for CUDA RNG states
    out = {}
    for backend, recompute in sorted({case[:2] for case in ACTIVATION_CASES}):
        plans = {}
        for seq, images in (case[2:] for case in ACTIVATION_CASES if case[:2] == (backend, recompute)):
            config = TrainConfig(train_iters=1, global_batch_size=1, seq_length=seq, stage=2, unfreeze_vit=True,
                                 packing_seq_length=seq, max_tiles_per_sequence=images, attention_backend=backend,
                                 **RECOMPUTE[recompute][0])
            plans[seq, images] = published_shape_plan(ACTIVATION_LLAVA, config, world_size=1, te=False, on_gpu=False)
        ranks = {case: memory_plan(plan, 80 * GIB).ranks[0] for case, plan in plans.items()}
        longest = plans[max(plans)]
        arch = longest.arch
        with as_rank(0, 1, 1):
            model = trained_model(longest)
            group = RECOMPUTE[recompute][1]
            if group:
                cut_below_the_layers(model)
            for (seq, images), rank in ranks.items():
                out[backend, recompute, seq, images] = rank, *saved_in_forward(model, arch, seq, images, group)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, recompute, seq, images", ACTIVATION_CASES)
def test_activations_are_within_10_percent_of_what_a_real_forward_saves(activations_planned_and_saved, backend,
                                                                        recompute, seq, images):
    rank, vision, lm = activations_planned_and_saved[backend, recompute, seq, images]
    assert rank.in_flight == 1
    assert rank.lm_activations == pytest.approx(lm, rel=0.10)
    assert rank.vision_activations == pytest.approx(vision, rel=0.10)
    # The check has teeth: every part is there, the tower's grows with the images.
    assert vision > images * 2**20 and lm > seq * 2**14


# A OneVision (the published 0.5B's shape, narrowed) with the same small vocabulary. Its cases:
# (sequence length, what the row holds): an anyres image of 1 x 2 tiles of 384 pixels and its base
# tile (3 tower inputs, 2214 features), and that image with a video of 4 frames (7 tower inputs).
# Its 7 query heads per K/V head: the CPU's kernels take them repeated, 1.5% over the plan
# (memory/activation_bytes.py's docstring).
TILED_LLAVA = narrowed(json.loads((SHAPES / "llava" / "llava-hf--llava-onevision-qwen2-0.5b-ov-hf.json").read_text()))
TILED_LLAVA.update(image_token_index=4000, video_token_index=4001)
TILED_LLAVA["text_config"].update(vocab_size=4096, bos_token_id=4002, eos_token_id=4003)
TILED_CASES = {"anyres image": (2560, [Media(IMAGE, 3, 384, 768)]),
               "anyres image and video": (3072, [Media(IMAGE, 3, 384, 768), Media(VIDEO, 4)])}


@pytest.fixture(scope="module")
def tiled_planned_and_saved():
    """{case: (the plan's rank, vision bytes, LM bytes) kept by a real CPU forward of the trainer's
    tiled model}, packed rows bounded by --max-tiles-per-sequence, videos of --video-frames."""
    from megatron_ext.memory.meta_ranks import as_rank
    from megatron_ext.memory.plan import memory_plan, published_shape_plan
    from megatron_ext.train.model_setup import trained_model
    from tests.train.saved_parts import saved_in_tiled_forward

    plans = {}
    for name, (seq, layout) in TILED_CASES.items():
        config = TrainConfig(train_iters=1, global_batch_size=1, seq_length=seq, stage=2, unfreeze_vit=True,
                             packing_seq_length=seq, max_tiles_per_sequence=sum(m.tiles for m in layout), video_frames=4,
                             attention_backend="sdpa")
        plans[name] = published_shape_plan(TILED_LLAVA, config, world_size=1, te=False, on_gpu=False)
    ranks = {name: memory_plan(plan, 80 * GIB).ranks[0] for name, plan in plans.items()}
    out = {}
    with as_rank(0, 1, 1):
        model = trained_model(plans["anyres image and video"])  # the longer: megatron cuts rows to its length
        for name, (seq, layout) in TILED_CASES.items():
            out[name] = ranks[name], *saved_in_tiled_forward(model, plans[name].arch, seq, layout)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", TILED_CASES)
def test_a_tiled_models_activations_are_within_10_percent_of_what_a_real_forward_saves(tiled_planned_and_saved,
                                                                                      name):
    rank, vision, lm = tiled_planned_and_saved[name]
    seq, layout = TILED_CASES[name]
    tiles = sum(m.tiles for m in layout)
    assert rank.lm_activations == pytest.approx(lm, rel=0.10)
    assert rank.vision_activations == pytest.approx(vision, rel=0.10)
    assert vision > tiles * 2**20 and lm > seq * 2**14


# (sequence parallel, sequence length, images) at TP 2, planned with Transformer Engine (sequence
# parallel by default there), and without it for contrast (lengths and image counts vary at TP 1).
TP2_CASES = [(True, 1280, 2), (False, 1280, 2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_each_tp2_ranks_activations_with_and_without_sequence_parallelism_are_within_10_percent(tmp_path):
    """Each rank of two, its real forward (activation_worker.py, gloo) against the plan's rank; sequence
    parallelism drops the plan by what it drops the forward by (the replicated part, halved)."""
    from megatron_ext.memory.plan import memory_plan, published_shape_plan
    from tests.support.helpers import run_ranks

    cases = [[dict(train_iters=1, global_batch_size=1, seq_length=seq, stage=2, unfreeze_vit=True, packing_seq_length=seq,
                   max_tiles_per_sequence=images, tp=2, sequence_parallel=sp), seq, images]
             for sp, seq, images in TP2_CASES]
    config = tmp_path / "llava.json"
    config.write_text(json.dumps(ACTIVATION_LLAVA))
    run_ranks(2, str(Path(__file__).with_name("activation_worker.py")), config, json.dumps(cases), tmp_path,
                 timeout=200)
    saved = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    planned = []
    for (options, seq, images), *by_rank in zip(cases, *saved):
        plan = published_shape_plan(ACTIVATION_LLAVA, TrainConfig(**options), world_size=2, te=True, on_gpu=False)
        (rank,) = memory_plan(plan, 80 * GIB).ranks  # both tensor ranks hold the same
        assert rank.tp_ranks == (0, 1) and plan.execution.model.sequence_parallel == options["sequence_parallel"]
        for vision, lm in by_rank:
            assert rank.lm_activations == pytest.approx(lm, rel=0.10), (options, seq, images)
            assert rank.vision_activations == pytest.approx(vision, rel=0.10), (options, seq, images)
        planned.append(rank.lm_activations)
    drop_planned, drop_saved = planned[1] - planned[0], saved[0][1][1] - saved[0][0][1]
    assert drop_saved > 0.15 * saved[0][1][1] and drop_planned == pytest.approx(drop_saved, rel=0.10)


def test_dpo_counts_its_reference_copy_and_suggests_precomputing():
    """--stage dpo holds a frozen copy of the model beside the trained one (its parameters, nothing
    else); precomputed reference log-probabilities and LoRA (adapters off) hold none."""
    from megatron_ext.memory.plan import memory_plan, plan_lines, refusal

    (sft,) = memory_plan(cpu_plan(stage=2), 80 * GIB).ranks
    (dpo,) = memory_plan(cpu_plan(stage="dpo"), 80 * GIB).ranks
    assert dpo.state == sft.state and dpo.reference_bytes == sft.state.param_bytes > 0
    assert dpo.total == sft.total + dpo.reference_bytes
    assert memory_plan(cpu_plan(stage="dpo", reference_logprobs="precompute"), 80 * GIB).ranks[0].reference_bytes == 0
    assert memory_plan(cpu_plan(stage="dpo", lora_rank=4), 80 * GIB).ranks[0].reference_bytes == 0
    plan = cpu_plan(stage="dpo")
    over = memory_plan(plan, int(dpo.total / 0.92) - 1)
    assert "DPO reference model" in plan_lines(over, "float32")[1]
    assert "--reference-logprobs precompute fits" in refusal(plan, over)
