"""Training throughput of a native-resolution model (Qwen2.5-VL, Qwen3-VL) on one device, ours and
transformers' on the same samples: tokens/s, TFLOP/s, MFU and peak memory.

    python bench/qwen_vl_bench.py                          # Qwen2.5-VL-3B's shape, stage 2, packed 4096, bf16
    python bench/qwen_vl_bench.py --hf                     # transformers' model on the same samples
    python bench/qwen_vl_bench.py --model qwen3_vl-2b      # Qwen3-VL-2B's shape
    python bench/qwen_vl_bench.py --model qwen2_5_vl-tiny  # the tests' tiny model: the same code on the CPU (CI)

The model is built from its published config with random weights (the tests' tiny tokenizer: its
special tokens replace the published ids). Each step's samples are synthetic conversations of one
image each, of random sizes between `--min-side` and `--max-side` pixels (each at its own resolution,
as the family's processor resizes it) and 20-400 words of text, the answer trained; stage 2 (the
vision tower frozen, its merger and the decoder trained). Ours runs them as the trainer does: the
task encoder's samples knapsack-packed to `--seq-length` (THD, no padding between samples), megatron
DDP, Adam and `train.step.train_step`. `--hf` runs transformers' model on the same samples as its
Trainer with bf16=True would (fp32 weights, autocast, sdpa, fused AdamW on a GPU), in the same packs
without padding (position ids: text positions above each sample's mRoPE ones, as transformers'
padding-free training takes them; `--no-packing`: padded micro batches of `--hf-micro-batch-size`),
with Liger-Kernel's kernels on a GPU where installed (`--liger`). FLOPs are the trainer's count
(`train.flops.iteration_flops`: the decoder 3x, the frozen tower's blocks 1x, its mergers 3x; logits
where they are computed: ours only where a loss is taken, transformers' at every position), so compare
tokens/s: sample tokens fed per second, padding not counted.
The last line printed is a JSON object.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402  (its sibling: timing, memory, warm-up)

from megatron_ext.train.flops import H100_BF16_PEAK_TFLOPS  # noqa: E402

# name -> (family, its published config in tests/shapes/qwen_vl; None: the tests' tiny model)
MODELS = {"qwen2_5_vl-3b": ("qwen2_5_vl", "Qwen--Qwen2.5-VL-3B-Instruct"),
          "qwen3_vl-2b": ("qwen3_vl", "Qwen--Qwen3-VL-2B-Instruct"),
          "qwen2_5_vl-tiny": ("qwen2_5_vl", None), "qwen3_vl-tiny": ("qwen3_vl", None)}
WORDS = ("the", "a", "picture", "shows", "red", "blue", "car", "tree", "house", "left", "right", "of", "small",
         "large", "two", "people", "near", "water", "sky", "and", "is", "with", "in", "on", "at")


def model_config(name: str) -> dict:
    """The model's config as a dict, its image and video ids the tiny tokenizer's."""
    from tests.support import qwen_vl

    family_name, published = MODELS[name]
    if published is None:
        return importlib.import_module(f"tests.support.{family_name}").tiny_config().to_dict()
    from tests.shapes import qwen_vl_shapes

    family = importlib.import_module(f"megatron_ext.families.{family_name}").FAMILY
    return {**family.complete(qwen_vl_shapes()[published]), "image_token_id": qwen_vl.IMAGE_TOKEN,
            "video_token_id": qwen_vl.VIDEO_TOKEN, "vision_start_token_id": qwen_vl.VISION_START,
            "vision_end_token_id": qwen_vl.VISION_END}


def make_plan(config: dict, tokenizer_dir: Path, options: dict, iters: int, seq_length: int):
    """The trainer's stage-2 plan, packed to `seq_length`, without checkpoint or dataset."""
    return gpu_bench.plan_of(config, tokenizer_dir, seq_length=seq_length, packing_seq_length=seq_length,
                             train_iters=iters, **options)


def synthetic_samples(encoder, count: int, sides: tuple[int, int], rng: np.random.Generator) -> list:
    """`count` encoded conversations: one random image of random size, a question and a trained answer."""
    from megatron.energon import Sample
    from PIL import Image

    from megatron_ext.data.conversation import sample_messages
    from megatron_ext.data.shard_format import place_images

    samples = []
    for i in range(count):
        height, width = (int(v) for v in rng.integers(*sides, 2))
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        question, answer = (" ".join(rng.choice(WORDS, int(rng.integers(*n)))) for n in ((10, 60), (10, 340)))
        messages = place_images(sample_messages(question, answer), 1)
        samples.append(encoder.encode_conversation(Sample(__key__=str(i), __restore_key__=()), messages, [image], []))
    return samples


def packed_micro_batches(encoder, samples: list) -> list[dict]:
    """The samples knapsack-packed into rows of the encoder's length, one row per micro batch, as the trainer's loader makes them."""
    return [encoder.batch([encoder.pack_selected_samples(group)]).as_dict()
            for group in encoder.select_samples_to_pack(samples)]


def run_ours(name: str, options: dict, iters: int, warmup: int, peak_tflops: float, seq_length: int,
             samples_per_step: int, sides: tuple[int, int]) -> dict:
    from megatron_ext.distributed import device, init_parallel, shutdown
    from megatron_ext.model.forward_step import make_forward_step
    from megatron_ext.model.mrope_inputs import inputs_for
    from megatron_ext.train.batches import task_encoder
    from megatron_ext.train.flops import TowerWork, iteration_flops
    from megatron_ext.train.model_setup import build_training_model
    from megatron_ext.train.step import train_step
    from megatron_ext.train.trainer import BATCH_STATS, TOWER_STATS, batch_stats

    with tempfile.TemporaryDirectory() as tokenizer_dir:
        _tiny_tokenizer(tokenizer_dir)
        plan = make_plan(model_config(name), Path(tokenizer_dir), options, warmup + 2 * iters, seq_length)
        encoder = task_encoder(tokenizer_dir, plan.arch, plan.config, plan.seq_length, plan.execution.alignment)
        rng = np.random.default_rng(0)
        steps = [packed_micro_batches(encoder, synthetic_samples(encoder, samples_per_step, sides, rng))
                 for _ in range(warmup + iters)]
    init_parallel(1, 1, seed=1234)
    trained = build_training_model(plan)
    inputs = inputs_for(plan.arch, trained.model, device())
    forward_step = make_forward_step(inputs)
    losses = []

    def run(micro_batches):
        losses.append(train_step(trained, forward_step, micro_batches, plan.seq_length, micro_batch_size=1).loss)

    gpu_bench.warm_up(run, steps, warmup, plan.execution.model.compile_layers)
    gpu_bench._synchronize()
    start = time.perf_counter()
    for micro_batches in steps[warmup:]:
        run(micro_batches)
    gpu_bench._synchronize()
    seconds = time.perf_counter() - start
    timed = dict(zip(BATCH_STATS, sum(batch_stats(step, inputs, plan.arch) for step in steps[warmup:]).tolist()))
    flops = iteration_flops(plan.arch, positions=timed["positions"], squared_lengths=timed["squared_lengths"],
                            images=timed["images"], lm_trained=True, vit_trained=False,
                            logit_positions=timed["logit_positions"],
                            tower=TowerWork(*(timed[stat] for stat in TOWER_STATS)))
    shutdown()
    return _result(name, "megatron-ext", seconds, iters, flops, timed["positions"], peak_tflops, losses,
                   sum(p.numel() for p in trained.model.parameters()),
                   attention_backend=plan.execution.model.attention_backend, packing=True, seq_length=plan.seq_length,
                   compile_layers=plan.execution.model.compile_layers, uncompiled=gpu_bench._uncompiled(plan),
                   vision_attention=plan.execution.model.vision_attention, dtype=plan.dtype,
                   micro_batches_per_step=round(sum(len(s) for s in steps[warmup:]) / iters, 2),
                   padding_share=1 - timed["positions"] / timed["model_positions"])


def hf_row(sample, image_token_id: int, video_token_id: int) -> tuple:
    """A sample as transformers' model takes it: (token ids, labels: the token itself where the token
    before it trains, else -100, media token types)."""
    import torch

    from megatron_ext.data.native_resolution import token_types

    trained = torch.cat([torch.zeros(1, dtype=torch.bool), sample.loss_mask[:-1].bool()])
    types = torch.from_numpy(token_types(sample.input_ids.numpy(), image_token_id, video_token_id)).int()
    return sample.input_ids, torch.where(trained, sample.input_ids, -100), types


def hf_micro_batches(samples: list, image_token_id: int, video_token_id: int, pad_token_id: int,
                     micro_batch_size: int) -> list[dict]:
    """The samples in rows padded to the micro batch's longest."""
    import torch

    batches = []
    for first in range(0, len(samples), micro_batch_size):
        group = samples[first:first + micro_batch_size]
        width = max(len(s.input_ids) for s in group)
        ids = torch.full((len(group), width), pad_token_id)
        labels = torch.full((len(group), width), -100)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        types = torch.zeros(len(group), width, dtype=torch.int)
        for row, s in enumerate(group):
            n = len(s.input_ids)
            ids[row, :n], labels[row, :n], types[row, :n] = hf_row(s, image_token_id, video_token_id)
            mask[row, :n] = 1
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask, "mm_token_type_ids": types,
                        **_media(group)})
    return batches


def hf_packed_micro_batches(model, packs: list[list], image_token_id: int, video_token_id: int) -> list[dict]:
    """The packs ours trains, each one row of transformers' model without padding, as its padding-free
    training takes them: position ids [4, 1, n], the text positions (restarting at every sample, from
    which transformers keeps attention within each sample) above each sample's own mRoPE positions
    (the model's `get_rope_index`); every sample's first label is -100."""
    import torch

    batches = []
    for pack in packs:
        rows = [hf_row(s, image_token_id, video_token_id) for s in pack]
        positions = []
        for s, (ids, _, types) in zip(pack, rows):
            mrope, _ = model.model.get_rope_index(ids[None], types[None], image_grid_thw=s.image_grid_thw)
            positions.append(torch.cat([torch.arange(len(ids))[None, None], mrope.to(torch.long)]))
        batches.append({"input_ids": torch.cat([ids for ids, _, _ in rows])[None],
                        "labels": torch.cat([labels for _, labels, _ in rows])[None],
                        "mm_token_type_ids": torch.cat([types for _, _, types in rows])[None],
                        "position_ids": torch.cat(positions, dim=-1), **_media(pack)})
    return batches


def _media(samples: list) -> dict:
    """The samples' images (the benchmark's conversations hold no videos)."""
    import torch

    return {"pixel_values": torch.cat([s.pixel_values for s in samples]),
            "image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}


def run_hf(name: str, iters: int, warmup: int, peak_tflops: float, seq_length: int, samples_per_step: int,
           sides: tuple[int, int], micro_batch_size: int, liger: bool | None = None, packing: bool = True) -> dict:
    """transformers' model on the same samples (`run_ours`' seed), trained as its Trainer with bf16=True
    trains: fp32 weights, autocast, sdpa, fused AdamW on a GPU; stage 2 (the tower frozen but its mergers);
    `packing`: in the packs ours trains, one row each (else padded micro batches of `micro_batch_size`);
    `liger`: Liger-Kernel's kernels (None: on a GPU where installed)."""
    import torch
    import transformers

    from megatron_ext import families
    from megatron_ext.train.batches import task_encoder
    from megatron_ext.train.flops import TowerWork, iteration_flops, tower_work

    config = model_config(name)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        _tiny_tokenizer(tokenizer_dir)
        plan = make_plan(config, Path(tokenizer_dir), {}, warmup + iters, seq_length)
        encoder = task_encoder(tokenizer_dir, plan.arch, plan.config, plan.seq_length, plan.execution.alignment)
        rng = np.random.default_rng(0)
        steps = [synthetic_samples(encoder, samples_per_step, sides, rng) for _ in range(warmup + iters)]
        packs = [encoder.select_samples_to_pack(samples) for samples in steps]
    arch, family = plan.arch, families.of(plan.arch)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    torch.manual_seed(1234)
    model_class = getattr(transformers, family.model_class)
    model = model_class._from_config(getattr(transformers, family.config_class).from_dict(config),
                                     attn_implementation="sdpa")
    liger = liger is not False and gpu_bench.use_liger(model, required=liger is True)
    model.to(device).train()
    model.model.visual.requires_grad_(False)
    for projection in family.projections:
        getattr(model.model.visual, projection).requires_grad_(True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=on_gpu)
    batched = [hf_packed_micro_batches(model, step_packs, arch.image_token_id, arch.video_token_id) if packing
               else hf_micro_batches(samples, arch.image_token_id, arch.video_token_id, encoder.pad_token_id,
                                     micro_batch_size) for samples, step_packs in zip(steps, packs)]
    # The timed steps' sample tokens, as the micro batches hold them (padding not counted).
    fed = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
              for batches in batched[warmup:] for b in batches)
    losses = []
    for step, batches in enumerate(batched):
        if step == warmup:
            gpu_bench._synchronize()
            start = time.perf_counter()
        losses.append(gpu_bench.hf_step(model, optimizer, trained, batches, device))
    gpu_bench._synchronize()
    seconds = time.perf_counter() - start
    timed = [s for samples in steps[warmup:] for s in samples]
    lengths = np.array([len(s.input_ids) for s in timed], dtype=np.float64)
    work = [tower_work(arch, {"image_grid_thw": s.image_grid_thw, "video_grid_thw": s.video_grid_thw}) for s in timed]
    tower = TowerWork(*(sum(getattr(w, field) for w in work) for field in ("patches", "full_pairs", "window_pairs")))
    flops = iteration_flops(arch, positions=lengths.sum(), squared_lengths=(lengths**2).sum(), images=len(timed),
                            lm_trained=True, vit_trained=False, tower=tower)
    return _result(name, "transformers", seconds, iters, flops, fed, peak_tflops, losses,
                   sum(p.numel() for p in model.parameters()), attention_backend="sdpa", packing=packing, liger=liger,
                   micro_batch_size=1 if packing else micro_batch_size,
                   micro_batches_per_step=round(sum(len(b) for b in batched[warmup:]) / iters, 2),
                   dtype="bfloat16 autocast" if on_gpu else "float32")


def _tiny_tokenizer(directory: str) -> None:
    from tests.support import qwen_vl

    qwen_vl.tiny_tokenizer(bos=False).save_pretrained(directory)


def _result(name: str, implementation: str, seconds: float, iters: int, flops: float, positions: float,
            peak_tflops: float, losses: list, parameters: int, **details) -> dict:
    tflops = flops / seconds / 1e12
    return {"model": name, "implementation": implementation, **details, "iterations": iters, "parameters": parameters,
            "loss_first": losses[0], "loss_last": losses[-1], "step_time_s": seconds / iters,
            "positions_per_step": positions / iters, "tokens_per_s": positions / seconds, "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops,
            "peak_mem_gib": gpu_bench._peak_memory_gib()}


@click.command()
@click.option("--model", "name", type=click.Choice(sorted(MODELS)), default="qwen2_5_vl-3b", show_default=True)
@click.option("--seq-length", type=int, default=None, help="Packed row length (default: 4096; 512 for a tiny model).")
@click.option("--samples-per-step", type=int, default=None, help="Conversations per optimizer step (default: 32; 8 tiny).")
@click.option("--min-side", type=int, default=None, help="Smallest image side in pixels (default: 224; 28 tiny).")
@click.option("--max-side", type=int, default=None, help="Largest image side in pixels (default: 896; 112 tiny).")
@click.option("--iters", type=int, default=5, show_default=True, help="Timed optimizer steps.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed steps first.")
@click.option("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS, show_default=True,
              help="The device's dense bf16 peak, for MFU.")
@click.option("--compile-layers/--no-compile-layers", default=None,
              help="Compile each decoder layer (default: the trainer's: on with a GPU).")
@click.option("--vision-attention", type=click.Choice(["sdpa", "varlen"]), default="sdpa", show_default=True)
@click.option("--hf", is_flag=True, help="transformers' model on the same samples instead of ours.")
@click.option("--packing/--no-packing", default=True, show_default=True,
              help="With --hf: the packs ours trains, one row each with position ids, or padded micro batches of "
                   "--hf-micro-batch-size (ours always packs).")
@click.option("--hf-micro-batch-size", type=int, default=4, show_default=True)
@gpu_bench.liger_option
def main(name, seq_length, samples_per_step, min_side, max_side, iters, warmup, peak_tflops, compile_layers,
         vision_attention, hf, packing, hf_micro_batch_size, liger):
    tiny = MODELS[name][1] is None
    seq_length = seq_length or (512 if tiny else 4096)
    samples_per_step = samples_per_step or (8 if tiny else 32)
    sides = (min_side or (28 if tiny else 224), max_side or (112 if tiny else 896))
    if hf:
        result = run_hf(name, iters, warmup, peak_tflops, seq_length, samples_per_step, sides, hf_micro_batch_size,
                        liger, packing)
    else:
        options = {"attention_backend": "sdpa", "vision_attention": vision_attention, "compile_layers": compile_layers}
        result = run_ours(name, options, iters, warmup, peak_tflops, seq_length, samples_per_step, sides)
    result["device"] = gpu_bench._device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
