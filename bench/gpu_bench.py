"""Training throughput of a LLaVA on one device: tokens/s, TFLOP/s, MFU and peak memory.

    python bench/gpu_bench.py                          # ~1B LLaVA, sdpa, packed to 4096, bf16 on GPU
    python bench/gpu_bench.py --attention-backend local --no-packing --recompute-granularity full
    python bench/gpu_bench.py --sweep                  # every variant below, each in its own process
    python bench/gpu_bench.py --preset tiny            # the same code on a tiny model (CPU, CI)
    python bench/gpu_bench.py --hf                     # transformers' model on the same packs (Liger if installed)

The model is built locally from configs with random weights: `1b` has Llama-3.2-1B's shape
(hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, tied embeddings) and a
CLIP ViT-L/14-336 tower (576 image positions). Samples are synthetic LLaVA-1.5-like: one image
and 30-435 text tokens (605-1011 positions, as in bench/data_bench.py's mix), the answer part
trained. The trainer's own pieces run them: `train.model_setup.build_training_model` (megatron
DDP, Adam, the stage-2 freeze: ViT frozen), `data.batching.BatchLayout` (knapsack packing,
alignment padding) and `train.step.train_step`.

FLOPs are `train.flops.iteration_flops`, the trainer's count: matmuls only, 2 per multiply-add;
causal attention counted per sample over L^2 / 2 (query, key) pairs; the frozen ViT forward only
(1x), the projector and LM 3x; no recomputation. MFU = TFLOP/s / --peak-tflops (989: H100 SXM
bf16 dense). tokens/s counts language-model positions holding samples (image embeddings
included, padding not). The last line printed is a JSON object with `tokens_per_s`,
`tflops_per_gpu`, `mfu` and `peak_mem_gib` (with --sweep: every variant under `variants`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_ext.train.flops import H100_BF16_PEAK_TFLOPS  # noqa: E402  (the checkout, put on the path above)


@dataclass(frozen=True)
class Preset:
    text: dict  # transformers LlamaConfig arguments
    vision: dict  # transformers CLIPVisionConfig arguments
    seq_length: int
    samples_per_step: int
    text_tokens: tuple[int, int]  # range of text tokens per sample


PRESETS = {
    "1b": Preset(
        text=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  tie_word_embeddings=True, head_dim=64),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, hidden_act="quick_gelu"),
        seq_length=4096, samples_per_step=64, text_tokens=(30, 435)),
    "tiny": Preset(
        text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1000, max_position_embeddings=1024),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=56, patch_size=14),
        seq_length=256, samples_per_step=16, text_tokens=(8, 120)),
}

# --sweep: the variants BENCHMARKS.md reports (TE ones only where Transformer Engine is present).
SWEEP = {
    "sdpa, packed": [],
    "sdpa, packed, logits at every position": ["--no-logits-where-loss"],
    "sdpa, packed, vision tower per micro batch": ["--vision-per-micro-batch"],
    # The layers as megatron-core runs them (the default compiles them on a GPU).
    "sdpa, packed, eager layers": ["--no-compile-layers"],
    # Weight gradients added into the fp32 buffer by their GEMMs (torch's, without Apex).
    "sdpa, packed, gradient accumulation fusion": ["--gradient-accumulation-fusion"],
    "sdpa, packed, fused AdamW": ["--fused-adam"],
    # FP8 without TE: the language model's linear layers in torchao's float8 GEMMs.
    "sdpa, packed, fp8 (torchao)": ["--fp8", "--fp8-backend", "torchao"],
    # The same samples in fewer micro batches: fewer kernel launches and main-grad additions per token.
    "sdpa, packed 8192": ["--seq-length", "8192"],
    "sdpa, packed 16384": ["--seq-length", "16384"],
    "sdpa, unpacked": ["--no-packing"],
    "sdpa, packed, full recompute": ["--recompute-granularity", "full"],
    # Its S x S scores need the selective recompute (its default): without, ~48 GiB at 4096.
    "local, packed, selective recompute": ["--attention-backend", "local"],
    # transformers as a user would train it: padding-free packs with position ids, Liger's kernels where installed.
    "transformers, sdpa, packed with position ids": ["--hf"],
    "transformers, sdpa, padded micro batches of 4": ["--hf", "--no-packing", "--no-liger"],
}
TE_SWEEP = {
    "te, packed": ["--attention-backend", "te"],
    "te, packed, fp8": ["--attention-backend", "te", "--fp8"],
}


def with_seq_length(preset: Preset, seq_length: int | None) -> Preset:
    """The preset packing to `seq_length` positions instead of its own (the same samples per step, in
    fewer, longer micro batches)."""
    return dataclasses.replace(preset, seq_length=seq_length) if seq_length else preset


def llava_config(preset: Preset) -> dict:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(**preset.text)
    config = LlavaConfig(text_config=text.to_dict(), vision_config=CLIPVisionConfig(**preset.vision).to_dict(),
                         image_token_index=text.vocab_size - 1, projector_hidden_act="gelu", vision_feature_layer=-2,
                         vision_feature_select_strategy="default", tie_word_embeddings=text.tie_word_embeddings)
    return {**config.to_dict(), "pad_token_id": text.vocab_size - 2}


def make_plan(preset: Preset, options: dict, iters: int):
    """A RunPlan as the trainer makes one, without checkpoint, tokenizer or dataset."""
    return plan_of(llava_config(preset), seq_length=preset.seq_length, train_iters=iters, **options)


def plan_of(hf_config: dict, tokenizer_dir: Path = REPO, **settings):
    """The trainer's stage-2 RunPlan for a model of `hf_config` (a LLaVA's or a vision-language family's)
    and the trainer options `settings`, on this process's device, without checkpoint or dataset."""
    import torch

    from megatron_ext import families
    from megatron_ext.config.execution_choices import resolve_execution
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import RunPlan
    from megatron_ext.data.prepared import SplitCount
    from megatron_ext.model.backends import te_available

    config = TrainConfig(stage=2, **settings).resolved()
    on_gpu = torch.cuda.is_available()
    execution = resolve_execution(config, world_size=1, te=te_available(), on_gpu=on_gpu)
    arch = families.read_model(hf_config)
    return RunPlan(config=config, arch=arch, families=families.of(arch), hf_config=hf_config, start=None,
                   resume=None, tokenizer_dir=tokenizer_dir, train_split=SplitCount(0), world_size=1,
                   dtype="bfloat16" if on_gpu else "float32", execution=execution, skip_ranges=())


def synthetic_samples(preset: Preset, arch, rng: np.random.Generator) -> list[tuple]:
    """One optimizer step's samples: (token ids with one image token, their next-token labels, the
    trained-answer mask, the image)."""
    import torch

    size = arch.vision.image_size
    samples = []
    for _ in range(preset.samples_per_step):
        n = int(rng.integers(*preset.text_tokens))
        ids = rng.integers(0, arch.text.vocab_size - 2, n)
        ids[1] = arch.image_token_index
        labels = np.append(ids[1:], arch.pad_token_id)
        answer = np.arange(n) >= int(0.4 * n)  # the last 60% of the tokens are the trained answer
        answer[-1] = False
        samples.append((ids, labels, answer, torch.randn(3, size, size)))
    return samples


def synthetic_micro_batches(plan, preset: Preset, packing: bool, rng: np.random.Generator) -> list[dict]:
    """One optimizer step's micro batches (one packed sequence or one sample each)."""
    from megatron.energon import Sample

    from megatron_ext.data.batching import BatchLayout

    arch = plan.arch
    size = arch.vision.image_size
    layout = BatchLayout(pad_token_id=arch.pad_token_id, image_token_index=arch.image_token_index,
                         img_seq_len=arch.img_seq_len, max_length=preset.seq_length, image_shape=(3, size, size),
                         alignment=plan.execution.alignment)
    samples = [layout.sample(Sample(__key__=str(i), __restore_key__=()), ids, labels, answer, [image], False)
               for i, (ids, labels, answer, image) in enumerate(synthetic_samples(preset, arch, rng))]
    groups = [layout.pack(pack) for pack in layout.packs(samples)] if packing else samples
    return [layout.batch([group]).as_dict() for group in groups]


def hf_rows(arch, samples: list[tuple]) -> list[tuple]:
    """The samples as transformers' LLaVA takes them: (token ids with the image token repeated once per
    image feature, labels: the token itself where the token before it is trained, else -100, image)."""
    import torch

    rows = []
    for ids, _, answer, image in samples:
        image_at = int(np.flatnonzero(ids == arch.image_token_index)[0])
        expanded = np.concatenate([ids[:image_at], np.full(arch.img_seq_len, arch.image_token_index), ids[image_at + 1:]])
        trained = np.concatenate([answer[:image_at], np.zeros(arch.img_seq_len, bool), answer[image_at + 1:]])
        labels = np.where(np.concatenate([[False], trained[:-1]]), expanded, -100)
        rows.append((torch.from_numpy(expanded), torch.from_numpy(labels), image))
    return rows


def hf_micro_batches(arch, samples: list[tuple], micro_batch_size: int) -> list[dict]:
    """Rows padded to the micro batch's longest (what a user without packing runs)."""
    import torch

    rows = hf_rows(arch, samples)
    batches = []
    for first in range(0, len(rows), micro_batch_size):
        group = rows[first:first + micro_batch_size]
        width = max(len(ids) for ids, _, _ in group)
        ids = torch.full((len(group), width), arch.pad_token_id)
        labels = torch.full((len(group), width), -100)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, (i, lab, _) in enumerate(group):
            ids[row, :len(i)], labels[row, :len(i)], mask[row, :len(i)] = i, lab, 1
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask,
                        "pixel_values": torch.stack([image for _, _, image in group])})
    return batches


def hf_packed_micro_batches(arch, samples: list[tuple], seq_length: int) -> list[dict]:
    """The samples packed as ours are (`packing.knapsack_bins` over the same lengths), each pack one row
    without padding: position ids restart at every sample, from which transformers masks attention to
    each sample's own positions (its padding-free training, as with `DataCollatorWithFlattening`), and
    every sample's first label is -100, so no sample predicts from the one before it."""
    import torch

    from megatron_ext.data.packing import knapsack_bins

    rows = hf_rows(arch, samples)
    batches = []
    for pack in knapsack_bins([len(ids) for ids, _, _ in rows], seq_length):
        group = [rows[i] for i in pack]
        batches.append({"input_ids": torch.cat([ids for ids, _, _ in group])[None],
                        "labels": torch.cat([labels for _, labels, _ in group])[None],
                        "position_ids": torch.cat([torch.arange(len(ids)) for ids, _, _ in group])[None],
                        "pixel_values": torch.stack([image for _, _, image in group])})
    return batches


def use_liger(model, required: bool) -> bool:
    """Liger-Kernel's Triton kernels patched into a transformers model as its Trainer's
    `use_liger_kernel=True` patches them (fused linear cross entropy, RMSNorm, SwiGLU, RoPE, by model
    type); unless `required`, only where liger-kernel is installed and a GPU runs its kernels (on a CPU
    they run only under Triton's interpreter, TRITON_INTERPRET=1, and its RMSNorm not even there)."""
    import torch

    if not required and not torch.cuda.is_available():
        return False
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        if required:
            raise click.UsageError("--liger: liger-kernel is not installed (pip install liger-kernel)") from None
        return False
    _apply_liger_kernel_to_instance(model=model)
    return True


def run_hf(preset_name: str, iters: int, warmup: int, peak_tflops: float, micro_batch_size: int,
           packing: bool = True, seq_length: int | None = None, liger: bool | None = None) -> dict:
    """transformers' LlavaForConditionalGeneration on the same samples, trained as its Trainer with
    bf16=True trains (fp32 weights, autocast), sdpa attention, fused AdamW on a GPU; stage 2 (the
    tower frozen). `packing`: the packs ours trains, one row each with position ids (else padded
    micro batches of `micro_batch_size`); `liger`: Liger-Kernel's kernels (None: on a GPU where installed)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from megatron_ext import families
    from megatron_ext.train.flops import iteration_flops

    preset = with_seq_length(PRESETS[preset_name], seq_length)
    hf_config = llava_config(preset)
    arch = families.read_llava(hf_config)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    torch.manual_seed(1234)
    model = LlavaForConditionalGeneration._from_config(LlavaConfig(**hf_config), attn_implementation="sdpa")
    liger = liger is not False and use_liger(model, required=liger is True)
    model.to(device).train()
    model.model.vision_tower.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=on_gpu)
    rng = np.random.default_rng(0)
    samples = [synthetic_samples(preset, arch, rng) for _ in range(warmup + iters)]
    steps = [hf_packed_micro_batches(arch, step, preset.seq_length) if packing
             else hf_micro_batches(arch, step, micro_batch_size) for step in samples]
    losses = []
    for step, batches in enumerate(steps):
        if step == warmup:
            _synchronize()
            start = time.perf_counter()
        losses.append(hf_step(model, optimizer, trained, batches, device))
    _synchronize()
    seconds = time.perf_counter() - start
    positions = [len(ids) - 1 + arch.img_seq_len for step in samples[warmup:] for ids, *_ in step]
    flops = iteration_flops(arch, positions=sum(positions), squared_lengths=sum(n * n for n in positions),
                            images=len(positions), lm_trained=True, vit_trained=False)
    tflops = flops / seconds / 1e12
    return {
        "preset": preset_name, "implementation": "transformers", "attention_backend": "sdpa", "packing": packing,
        "liger": liger, "micro_batch_size": 1 if packing else micro_batch_size,
        "micro_batches_per_step": round(sum(len(s) for s in steps[warmup:]) / iters, 2),
        "dtype": "bfloat16 autocast" if on_gpu else "float32",
        "iterations": iters, "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": losses[0], "loss_last": losses[-1], "step_time_s": seconds / iters,
        "tokens_per_s": sum(positions) / seconds, "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops,
        "peak_mem_gib": _peak_memory_gib(),
    }


def hf_step(model, optimizer, trained: list, batches: list[dict], device) -> float:
    """One optimizer step of a transformers model over `batches` as its Trainer with bf16=True takes one
    on a GPU (autocast; fp32 elsewhere): gradients accumulated, clipped to norm 1; the mean loss."""
    import torch

    total = 0.0
    for batch in batches:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = hf_loss(model, batch, device) / len(batches)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def hf_loss(model, batch: dict, device):
    """transformers' mean loss over `batch`'s trained tokens. Without a cache: with one (its config's
    `use_cache`, on by default) transformers does not look for packs in the position ids, and packed
    samples would attend to each other under sdpa."""
    return model(**{k: v.to(device, non_blocking=True) for k, v in batch.items()}, use_cache=False).loss


def _with_host_reads(inputs):
    """The step as it was before it stopped reading device values back: megatron-core's own LLaVA
    preprocessing and its per-tensor gradient norm (the A/B of BENCHMARKS.md)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    return dataclasses.replace(inputs, host_layout=False, logits_where_loss=False, vision_once_per_step=False)


def _synchronize():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_one(preset_name: str, options: dict, packing: bool, iters: int, warmup: int, peak_tflops: float,
            host_reads: bool = False, seq_length: int | None = None, vision_per_micro_batch: bool = False) -> dict:

    from megatron_ext.distributed import device, init_parallel, shutdown
    from megatron_ext.model.forward_step import make_forward_step
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.train.flops import iteration_flops
    from megatron_ext.train.model_setup import build_training_model
    from megatron_ext.train.step import train_step
    from megatron_ext.train.trainer import BATCH_STATS, batch_stats

    preset = with_seq_length(PRESETS[preset_name], seq_length)
    plan = make_plan(preset, options, warmup + 2 * iters)
    init_parallel(1, 1, seed=1234)
    trained = build_training_model(plan)
    inputs = ModelInputs.for_model(plan.arch, trained.model, device())
    if host_reads:
        inputs = _with_host_reads(inputs)
    if vision_per_micro_batch:
        inputs = dataclasses.replace(inputs, vision_once_per_step=False)
    forward_step = make_forward_step(inputs)
    rng = np.random.default_rng(0)
    steps = [synthetic_micro_batches(plan, preset, packing, rng) for _ in range(warmup + iters)]
    losses, tower_calls = [], []
    # On the tower's first part (its patch embedding): the tower's own call is shadowed where its output
    # was computed once per step, and hooks would count that call too.
    next(trained.model.vision_model.children()).register_forward_hook(lambda *_: tower_calls.append(1))

    def run(micro_batches):
        losses.append(train_step(trained, forward_step, micro_batches, plan.seq_length, micro_batch_size=1).loss)

    warm_up(run, steps, warmup, plan.execution.model.compile_layers)
    _synchronize()
    start = time.perf_counter()
    tower_calls.clear()
    for micro_batches in steps[warmup:]:
        run(micro_batches)
    _synchronize()
    seconds = time.perf_counter() - start
    timed = dict(zip(BATCH_STATS, sum(batch_stats(step, inputs, plan.arch) for step in steps[warmup:]).tolist()))
    flops = iteration_flops(plan.arch, positions=timed["positions"], squared_lengths=timed["squared_lengths"],
                            images=timed["images"], lm_trained=True, vit_trained=False,
                            logit_positions=timed["logit_positions"])
    tflops = flops / seconds / 1e12
    shutdown()
    return {
        "preset": preset_name, "attention_backend": plan.execution.model.attention_backend, "packing": packing,
        "recompute": plan.execution.model.recompute_granularity or "none", "fp8": plan.execution.model.fp8,
        "logits_where_loss": inputs.logits_where_loss,
        "compile_layers": plan.execution.model.compile_layers, "uncompiled": _uncompiled(plan),
        "gradient_accumulation_fusion": plan.execution.model.gradient_accumulation_fusion,
        "fused_adam": plan.config.fused_adam,
        "dtype": plan.dtype, "seq_length": plan.seq_length, "iterations": iters,
        "micro_batches_per_step": round(sum(len(s) for s in steps[warmup:]) / iters, 2),
        "vision_tower_forwards_per_step": round(len(tower_calls) / iters, 2),
        "parameters": sum(p.numel() for p in trained.model.parameters()),
        "loss_first": losses[0], "loss_last": losses[-1],
        "padding_share": 1 - timed["positions"] / timed["model_positions"],
        "step_time_s": seconds / iters, "tokens_per_s": timed["positions"] / seconds, "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops, "peak_mem_gib": _peak_memory_gib(),
    }


def warm_up(run, steps: list, warmup: int, compiled: bool) -> None:
    """`run` the first `warmup` steps untimed; with compiled layers every later step once too: torch.compile makes
    a graph for each new range of lengths (and with and without grad) at whichever step first brings it."""
    for micro_batches in steps[:warmup] + (steps[warmup:] if compiled else []):
        run(micro_batches)


def _uncompiled(plan) -> list[str]:
    """With --compile-layers, what torch.compile left uncompiled (empty: every layer compiled whole)."""
    from megatron_ext.model.compiled_layers import compile_problems

    return compile_problems() if plan.execution.model.compile_layers else []


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _failure(output: str) -> str:
    """The error a failed variant died of: its last exception line, not the warnings printed at exit
    (NCCL's destroy_process_group notice came last on an H100)."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("[rank0]: ") and "Error" in line]
    return (errors or lines or ["no output"])[-1]


def sweep(argv: list[str]) -> dict:
    """Every variant in its own process (clean peak memory), same other options."""
    from megatron_ext.model.backends import te_available

    variants = {**SWEEP, **(TE_SWEEP if te_available() else {})}
    results = {}
    for name, extra in variants.items():
        proc = subprocess.run([sys.executable, __file__, *argv, *extra], capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            results[name] = {"error": _failure(proc.stderr or proc.stdout)}
        else:
            results[name] = json.loads(lines[-1])
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    print("| variant | tokens/s | TFLOP/s | MFU | peak GiB | step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | |")
        else:
            print(f"| {name} | {r['tokens_per_s']:.0f} | {r['tflops_per_gpu']:.3g} | {r['mfu']:.2%} | "
                  f"{r['peak_mem_gib']:.1f} | {r['step_time_s']:.3f} |")
    return {"device": _device_name(), "variants": results}


# Also bench/gpu_profile.py's (the Liger option: bench/qwen_vl_bench.py's).
compile_layers_option = click.option(
    "--compile-layers/--no-compile-layers", default=None,
    help="Each transformer layer compiled with torch.compile or eager (default: the trainer's: compiled on a GPU at "
         "TP 1 with sdpa).")
liger_option = click.option(
    "--liger/--no-liger", default=None, help="With --hf: Liger-Kernel's kernels patched into transformers' model, as "
    "its Trainer's use_liger_kernel=True patches them (default: on a GPU where liger-kernel is installed).")
gradient_accumulation_fusion_option = click.option(
    "--gradient-accumulation-fusion/--no-gradient-accumulation-fusion", default=None,
    help="Weight gradients added into the fp32 gradient buffer within their GEMMs (default: the trainer's).")


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="1b", show_default=True)
@click.option("--attention-backend", type=click.Choice(["auto", "te", "sdpa", "local"]), default="sdpa",
              show_default=True)
@click.option("--packing/--no-packing", default=True, show_default=True,
              help="Pack samples into sequences of the preset's length (else one sample per micro batch).")
@click.option("--recompute-granularity", type=click.Choice(["auto", "none", "selective", "full"]), default="auto",
              show_default=True, help="auto: the trainer's default (selective for the local backend, whose S x S "
              "scores would not fit, else none).")
@click.option("--seq-length", type=int, default=None,
              help="Pack to this many positions instead of the preset's (4096 for 1b).")
@click.option("--fp8", is_flag=True,
              help="FP8 in the language model (--fp8-backend: te, with --attention-backend te, or torchao).")
@click.option("--fp8-backend", type=click.Choice(["te", "torchao"]), default="te", show_default=True)
@click.option("--iters", type=int, default=10, show_default=True, help="Timed optimizer steps.")
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed steps first.")
@click.option("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS, show_default=True,
              help="Peak dense TFLOP/s the MFU is taken against (989: H100 SXM bf16).")
@click.option("--sweep", "run_sweep", is_flag=True, help="Run every variant of BENCHMARKS.md, each in its own process.")
@click.option("--logits-where-loss/--no-logits-where-loss", default=True, show_default=True,
              help="Logits and cross entropy only where a loss is taken (the trainer's default), or everywhere.")
@click.option("--hf", is_flag=True, help="Time transformers' LlavaForConditionalGeneration on the same samples "
              "instead, as its Trainer with bf16=True trains (sdpa; the same packs, one row each with position ids, "
              "or with --no-packing padded micro batches of --hf-micro-batch-size).")
@click.option("--hf-micro-batch-size", type=int, default=4, show_default=True)
@liger_option
@click.option("--host-reads", is_flag=True, help="The step before it stopped reading the device back: megatron-core's "
              "LLaVA preprocessing and per-tensor gradient norm (for an A/B).")
@compile_layers_option
@gradient_accumulation_fusion_option
@click.option("--fused-adam", is_flag=True, help="torch's fused AdamW instead of its foreach one (the trainer's "
              "--fused-adam).")
@click.option("--vision-per-micro-batch", is_flag=True, help="Run the frozen vision tower per micro batch, as "
              "before it ran once per step over all the step's images (for an A/B).")
def main(preset, attention_backend, packing, recompute_granularity, seq_length, fp8, fp8_backend, iters, warmup,
         peak_tflops, run_sweep,
         logits_where_loss, hf, hf_micro_batch_size, liger, host_reads, compile_layers, gradient_accumulation_fusion,
         fused_adam, vision_per_micro_batch):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if run_sweep:
        argv = ["--preset", preset, "--iters", str(iters), "--warmup", str(warmup), "--peak-tflops", str(peak_tflops)]
        print(json.dumps(sweep(argv)))
        return
    if hf:
        result = run_hf(preset, iters, warmup, peak_tflops, hf_micro_batch_size, packing, seq_length, liger)
        print(json.dumps({"device": _device_name(), **result}))
        return
    options = {"attention_backend": attention_backend, "recompute_granularity": recompute_granularity, "fp8": fp8,
               "fp8_backend": fp8_backend,
               "packing_seq_length": with_seq_length(PRESETS[preset], seq_length).seq_length if packing else None,
               "logits_where_loss": logits_where_loss, "compile_layers": compile_layers,
               "gradient_accumulation_fusion": gradient_accumulation_fusion, "fused_adam": fused_adam}
    result = run_one(preset, options, packing, iters, warmup, peak_tflops, host_reads, seq_length,
                     vision_per_micro_batch)
    print(json.dumps({"device": _device_name(), **result}))


if __name__ == "__main__":
    main()
