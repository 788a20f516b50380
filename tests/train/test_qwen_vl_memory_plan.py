"""The memory plan of a Qwen-VL run (megatron_ext/memory/native_vision_bytes.py) against real
forwards of the trainer's model on the CPU: its tower's activations for as many of the largest
images as fill the sequence, and its language model's, each within 10% of what autograd saves.

The models are published shapes narrowed (`tests.shapes.narrowed_qwen_vl`: every head count, block,
window and DeepStack index as published), with a vocabulary of 4096 so that the logits do not
outweigh the two decoder layers checked here. The tower trains (`--unfreeze-vit`), so it keeps
activations. Their state bytes are checked against a real TP2 run's in test_qwen2_5_vl_training.
"""

from __future__ import annotations

import pytest

from megatron_ext.config.options import TrainConfig
from tests.shapes import narrowed_qwen_vl, qwen_vl_shapes

GIB = 2**30
# (published shape, sequence length, grid in patches): a sequence of 256 positions bounds an image
# to 256 merged tokens (the processor's own bound, 1,280 of them, is checked below), 16 x 16.
CASES = {"Qwen2.5-VL": ("Qwen--Qwen2.5-VL-7B-Instruct", 256, (1, 32, 32)),
         "Qwen3-VL": ("Qwen--Qwen3-VL-2B-Instruct", 256, (1, 32, 32))}


def small_vocabulary(config: dict) -> dict:
    """`config` with a vocabulary of 4096, its special tokens moved into it."""
    text = config.get("text_config", config)
    text["vocab_size"] = 4096
    config.update(image_token_id=4000, video_token_id=4001, vision_start_token_id=4002, vision_end_token_id=4003)
    text.update(bos_token_id=4004, eos_token_id=4005)
    return config


@pytest.fixture(scope="module")
def planned_and_saved():
    """{family: (the plan's rank, its images per sequence, vision bytes, LM bytes) kept by a real
    CPU forward of the trainer's model (fp32, TP1, sdpa) over a row of the largest image}."""
    from megatron_ext.compat import cpu_support
    from megatron_ext.memory.meta_ranks import as_rank
    from megatron_ext.memory.plan import memory_plan, published_shape_plan, vision_inputs_per_sequence
    from megatron_ext.train.model_setup import trained_model
    from tests.train.saved_parts import saved_in_native_forward

    cpu_support.apply()
    out = {}
    for family, (shape, seq, grid) in CASES.items():
        config = small_vocabulary(narrowed_qwen_vl(qwen_vl_shapes()[shape]))
        options = TrainConfig(train_iters=1, global_batch_size=1, seq_length=seq, stage=2, unfreeze_vit=True,
                              attention_backend="sdpa", recompute_granularity="none")
        plan = published_shape_plan(config, options, world_size=1, te=False, on_gpu=False)
        (rank,) = memory_plan(plan, 80 * GIB).ranks
        with as_rank(0, 1, 1):
            out[family] = rank, vision_inputs_per_sequence(plan), *saved_in_native_forward(trained_model(plan), plan.arch,
                                                                                            grid, 1)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", CASES)
def test_a_qwen_vl_runs_activations_are_within_10_percent_of_what_a_real_forward_saves(planned_and_saved, family):
    rank, images, vision, lm = planned_and_saved[family]
    seq = CASES[family][1]
    assert images == 1 and rank.in_flight == 1
    assert rank.vision_activations == pytest.approx(vision, rel=0.10)
    assert rank.lm_activations == pytest.approx(lm, rel=0.10)
    # The check has teeth: every part is there (the tower trains: 1,024 patches through its blocks).
    assert vision > 2**25 and lm > seq * 2**14


@pytest.mark.parametrize("shape, tokens, count", [("Qwen--Qwen2.5-VL-7B-Instruct", 1280, 4),
                                                  ("Qwen--Qwen3-VL-8B-Instruct", 980, 5)])
def test_the_largest_image_planned_is_the_largest_the_task_encoders_processor_gives(shape, tokens, count):
    """Images of any size and shape come out of the processor with at most the planned patches, one
    of them exactly; a sequence of 4,096 positions holds `count` of them (4096 / tokens, rounded up)."""
    import math

    from PIL import Image

    from megatron_ext.data.native_resolution import image_inputs
    from megatron_ext.data.native_resolution_encoder import vision_of
    from megatron_ext.families import complete_config, read_model
    from megatron_ext.memory.native_vision_bytes import largest_images

    vision = vision_of(read_model(complete_config(qwen_vl_shapes()[shape])))
    largest = largest_images(vision, 4096)
    patches = [math.prod(image_inputs([Image.new("RGB", size)], vision)["image_grid_thw"][0].tolist())
               for size in ((1120, 896), (1024, 1024), (4000, 3000), (3000, 200), (5000, 5000))]
    assert max(patches) == largest.patches == 4 * tokens
    assert largest.count == count


def test_max_pixels_sets_the_largest_image_the_memory_plan_counts(planned_and_saved):
    """Qwen3-VL's tower at a sequence of 256 positions: the family's bound lets one image fill it
    (256 merged tokens, 1,024 patches: the plan above); --max-pixels of 100 merged tokens
    (100 x 32 x 32) makes the largest image 100 tokens and the plan counts ceil(256 / 100) = 3 of
    them, 300 tokens, so the tower's bytes grow by 300 / 256: under flash attention they are linear
    in the tokens (measured: 1.171875, exactly)."""
    from megatron_ext.config.run_plan import native_vision
    from megatron_ext.memory.native_vision_bytes import LargestImages, largest_images
    from megatron_ext.memory.plan import memory_plan, published_shape_plan, vision_inputs_per_sequence

    shape, seq, _ = CASES["Qwen3-VL"]
    family_rank, family_images, *_ = planned_and_saved["Qwen3-VL"]
    options = TrainConfig(train_iters=1, global_batch_size=1, seq_length=seq, stage=2, unfreeze_vit=True,
                          attention_backend="sdpa", recompute_granularity="none", max_pixels=100 * 32 * 32)
    plan = published_shape_plan(small_vocabulary(narrowed_qwen_vl(qwen_vl_shapes()[shape])), options, world_size=1,
                                te=False, on_gpu=False)
    (rank,) = memory_plan(plan, 80 * GIB).ranks
    assert family_images == 1
    assert largest_images(native_vision(plan), seq) == LargestImages((1, 2, 200), 3)
    assert vision_inputs_per_sequence(plan) == 3
    assert rank.vision_activations / family_rank.vision_activations == pytest.approx(300 / 256, rel=1e-3)


def test_a_video_bound_above_the_image_bound_is_the_largest_input_planned():
    """A checkpoint whose video processor allows more pixels than its image processor (without
    --max-pixels, which caps both): the plan counts the video's frame pair."""
    from dataclasses import replace

    from megatron_ext.data.native_resolution import QWEN2_5_VL
    from megatron_ext.memory.native_vision_bytes import LargestImages, largest_images

    vision = replace(QWEN2_5_VL, max_pixels=100 * 28 * 28, video_max_pixels=300 * 28 * 28)
    assert largest_images(vision, 4096) == LargestImages((1, 2, 600), 14)
    assert largest_images(replace(vision, video_max_pixels=50 * 28 * 28), 4096) == LargestImages((1, 2, 200), 41)
