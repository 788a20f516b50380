"""A Qwen-VL vision tower's step under each --vision-attention (`model/tower_attention.py`), side by
side in one process: transformers' sdpa (one call per image, and per window in Qwen2.5-VL's windowed
layers) against varlen (one call per layer), then varlen with the blocks compiled as --compile-layers
compiles them.

    python bench/tower_attention_bench.py                  # the published 7B/8B towers, bf16, one GPU
    python bench/tower_attention_bench.py --preset tiny    # the tests' tiny towers on the CPU (CI)

Each row times the tower's forward, and forward + backward (as --unfreeze-vit trains it), median over
`--iters` after one untimed run, the tower's inputs computed on the host as the trainer gives them;
with the peak memory of forward + backward and the features' relative difference from sdpa's.
Prints a Markdown table, then a JSON line with every row.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_bench import _synchronize  # noqa: E402
from bench.inputs_bench import median_us  # noqa: E402
from bench.tower_inputs_bench import MODELS  # noqa: E402
from megatron_ext.model.tower_attention import compilable_blocks  # noqa: E402

# (T, H, W) in patches per image or video. 1008 x 1008 px is 72 x 72 patches of 14 px: 81 of Qwen2.5-VL's
# windows (112 px) each; the same counts stand for both families. Fewer than tower_inputs_bench's
# images, for the backward's activations: a 7B tower holds ~3 GB per layer at 20k patches.
BATCHES = {"4 images of 72 x 72 patches": [[1, 72, 72]] * 4,
           "16 images of 32 x 32 patches": [[1, 32, 32]] * 16,
           "a video of 16 x 32 x 32 patches": [[16, 32, 32]]}
# The tiny preset's: tests/model/test_tower_inputs.py's grids, and many small images.
TINY_BATCHES = {"3 odd images and a video": [[1, 6, 10], [1, 4, 2], [2, 8, 6]], "16 images of 8 x 8": [[1, 8, 8]] * 16}
# Each row's name -> its --vision-attention; the compiled row's blocks as --compile-layers compiles them.
COMPILED = "varlen, compiled blocks"
ROWS = {"sdpa": "sdpa", "varlen": "varlen", COMPILED: "varlen"}


def tower(family_name: str, preset: str, device: torch.device, dtype: torch.dtype):
    """(a randomly initialised tower of `family_name`, what it computes from a grid)."""
    import functools

    family = importlib.import_module(f"megatron_ext.families.{family_name}").FAMILY
    if preset == "tiny":
        config = importlib.import_module(f"tests.support.{family_name}").tiny_config()
    else:
        from tests.shapes import qwen_vl_shapes

        config = family.complete(qwen_vl_shapes()[MODELS[family_name]])
    torch.manual_seed(0)
    module = family.tower(family.read(config), dtype).to(device).train()
    return module, functools.partial(family.tower_inputs, module)


def _timed_ms(func, iters: int) -> float:
    """`func`'s median milliseconds, the device's work included (each call waits for it)."""
    return median_us(lambda: (func(), _synchronize()), iters) / 1000


def pixels_of(module, grid: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    config = module.config
    generator = torch.Generator(device).manual_seed(0)
    return torch.randn(int(grid.prod(-1).sum()), config.in_channels * config.temporal_patch_size * config.patch_size ** 2,
                       device=device, dtype=dtype, generator=generator)


def measure(module, compute, grid: torch.Tensor, pixels: torch.Tensor, attention: str, iters: int) -> dict:
    from megatron_ext.model import tower_attention
    from megatron_ext.model.tower_inputs import attends_through_flash, tower_kwargs

    tower_attention.use(module, attention)
    device = pixels.device

    def forward():
        given = tower_kwargs(compute, grid, lambda t: t.to(device, non_blocking=True), attends_through_flash(module))
        return module(pixels, grid_thw=grid.to(device), **given).pooler_output

    def forward_backward():
        forward().float().square().mean().backward()

    with torch.no_grad():
        forward_ms = _timed_ms(forward, iters)
        features = forward().float()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step_ms = _timed_ms(forward_backward, iters)
    except torch.OutOfMemoryError:  # the row says so; the others still run
        step_ms = None
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    module.zero_grad(set_to_none=True)
    return {"forward_ms": forward_ms, "forward_backward_ms": step_ms, "peak_gib": peak, "features": features}


@click.command()
@click.option("--preset", type=click.Choice(["published", "tiny"]), default="published", show_default=True,
              help="published: Qwen2.5-VL-7B's and Qwen3-VL-8B's towers in bf16 on a GPU; tiny: the tests' towers.")
@click.option("--iters", type=int, default=5, show_default=True)
def main(preset: str, iters: int):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = BATCHES if preset == "published" else TINY_BATCHES
    rows = []
    for family_name in MODELS:
        module, compute = tower(family_name, preset, device, dtype)
        inputs = {}
        for name, grids in batches.items():
            grid = torch.tensor(grids)
            inputs[name] = grid, pixels_of(module, grid, device, dtype)
        results = {}
        for attention in ROWS:
            if attention == COMPILED:  # as --compile-layers compiles them; in place, so the last row
                for block in compilable_blocks(module):
                    block.compile(dynamic=True)
            for name, (grid, pixels) in inputs.items():
                results[name, attention] = measure(module, compute, grid, pixels, ROWS[attention], iters)
        references = {name: results[name, "sdpa"]["features"] for name in inputs}
        for (name, attention), result in results.items():
            reference = references[name]
            difference = (result.pop("features") - reference).norm() / reference.norm()
            rows.append({"family": family_name, "batch": name, "attention": attention,
                         "relative_difference": float(difference), **result})
        del module
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {dtype}\n")
    print("| family | micro batch | attention | forward ms | forward + backward ms | peak GiB | vs sdpa |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "-"
        step = f"{row['forward_backward_ms']:.1f}" if row["forward_backward_ms"] is not None else "out of memory"
        print(f"| {row['family']} | {row['batch']} | {row['attention']} | {row['forward_ms']:.1f} | {step} | {peak} | "
              f"{row['relative_difference']:.1e} |")
    print(json.dumps({"device": str(device), "dtype": str(dtype), "rows": rows}))


if __name__ == "__main__":
    main()
