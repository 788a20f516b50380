"""Host work per micro batch for what a Qwen-VL tower computes from its image grids
(`model/tower_inputs.py`: each family's `tower_inputs`), at the published towers' settings.

    OMP_NUM_THREADS=1 python bench/tower_inputs_bench.py [--repeat 20]

The trainer computes these on the host from the batch it holds, so that a GPU never waits for a read
of its grid; the cost moves to the host, where it overlaps the device's work on the micro batch before.
The towers are built on `meta` (their settings only). Prints a Markdown table, then a JSON line
(median milliseconds per micro batch by family and batch).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.inputs_bench import median_us  # noqa: E402

MODELS = {"qwen2_5_vl": "Qwen--Qwen2.5-VL-7B-Instruct", "qwen3_vl": "Qwen--Qwen3-VL-8B-Instruct"}
# (T, H, W) in patches per image or video: 1008 x 1008 px is 72 x 72 patches of 14 px (Qwen2.5-VL);
# the same counts stand for both families.
BATCHES = {"8 images of 72 x 72 patches": [[1, 72, 72]] * 8,
           "32 images of 32 x 32 patches": [[1, 32, 32]] * 32,
           "a video of 16 x 32 x 32 patches": [[16, 32, 32]]}


def tower_and_compute(family_name: str):
    from tests.shapes import qwen_vl_shapes

    family = importlib.import_module(f"megatron_ext.families.{family_name}").FAMILY
    with torch.device("meta"):
        tower = family.tower(family.read(family.complete(qwen_vl_shapes()[MODELS[family_name]])))
    return tower, family.tower_inputs


@click.command()
@click.option("--repeat", default=20, show_default=True)
def main(repeat: int):
    results = {}
    for family_name in MODELS:
        tower, compute = tower_and_compute(family_name)
        for name, grids in BATCHES.items():
            grid = torch.tensor(grids)
            results[f"{family_name}: {name}"] = median_us(lambda: compute(tower, grid), repeat) / 1000
    print("| family: micro batch | host ms |\n|---|---:|")
    for name, ms in results.items():
        print(f"| {name} | {ms:.2f} |")
    print(json.dumps({name: round(ms, 3) for name, ms in results.items()}))


if __name__ == "__main__":
    main()
