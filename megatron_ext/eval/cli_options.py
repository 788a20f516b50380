"""Click options shared by scripts/eval/*.py: which checkpoint, which layout, how to sample."""

from __future__ import annotations

import click

from megatron_ext.data.image_aspects import IMAGE_ASPECTS
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES
from megatron_ext.model.backends import COMPUTE_DTYPES


def checkpoint_options(func):
    for decorator in reversed([
        click.option("--megatron-dir", type=click.Path(), help="Megatron checkpoint: ROOT (its latest snapshot) or ROOT/iter_N / ROOT/release."),
        click.option("--hf-dir", type=click.Path(), help="Hugging Face checkpoint directory (a LLaVA, Qwen2.5-VL or Qwen3-VL)."),
        click.option("--tp", type=int, help="Tensor-parallel size to run at (Megatron; default: as saved if the process count fits, else 1)."),
        click.option("--pp", type=int, help="Pipeline-parallel size to run at (Megatron; default: as saved if the process count fits, else 1)."),
        click.option("--chat-template", help="'tokenizer', a name from megatron_ext/data/chat_templates or a .jinja file (default: as trained, else the tokenizer's)."),
        click.option("--dtype", type=click.Choice(["auto", *COMPUTE_DTYPES]), default="auto", show_default=True,
                     help="Compute dtype, whatever the checkpoint stores (auto: bfloat16 on GPU, float32 on CPU)."),
        click.option("--image-aspect", type=click.Choice(IMAGE_ASPECTS),
                     help="How images are fitted to the vision tower (default: as trained, else crop)."),
    ]):
        func = decorator(func)
    return func


video_frames_option = click.option(
    "--video-frames", type=click.IntRange(min=1), default=DEFAULT_VIDEO_FRAMES, show_default=True,
    help="Frames sampled uniformly from each video (LLaVA-OneVision, Qwen2.5-VL; in benchmark.py, on the Megatron path).")


def sampling_options(default_max_new_tokens: int):
    def wrap(func):
        for decorator in reversed([
            click.option("--max-new-tokens", type=int, default=default_max_new_tokens, show_default=True, help="Most tokens to generate per answer."),
            click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy; > 0: sample at this temperature."),
            click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling: keep the smallest token set with this probability mass."),
            click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed."),
        ]):
            func = decorator(func)
        return func

    return wrap


def make_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int) -> SamplingOptions:
    return SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed).check()
