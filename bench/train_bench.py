"""CPU iteration time of the tiny demo model at TP1, TP2 and PP2 (the trainer, end to end).

    python bench/train_bench.py [--iters 40] [--workdir DIR]

Builds the tiny LLaVA (Llama 2x64 GQA + CLIP 2x32, 56x56 images) and a synthetic dataset, then
runs scripts/train/pretrain_llava.py under torchrun for each layout with the same global batch
(8 samples = 2 micro batches of 4 per data-parallel rank, stage 2, fp32, seq 256) and reports
the median iteration time after the first 5 iterations, from each run's metrics.jsonl.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"TP1": (1, []), "TP2": (2, ["--tp", "2"]), "PP2": (2, ["--pp", "2"]), "DP2": (2, [])}


def prepare(work: Path) -> tuple[Path, Path]:
    """The tiny LLaVA converted at TP1 and the prepared 256-sample synthetic dataset."""
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset
    from megatron_ext.demo.tiny_models import make_all
    from megatron_ext.hf.build_llava import build_llava

    tiny = make_all(work / "tiny")
    hf = build_llava(work / "hf", str(tiny["text"]), str(tiny["vision-clip"]))
    checkpoint = convert(hf, work / "megatron", tp=1, pp=1)
    source = make_synthetic_dataset(work / "src", SyntheticSpec(num_samples=256))
    data = work / "energon"
    build_energon_dataset(source, data, split_ratio="9,1,0", samples_per_shard=16, num_workers=0)
    return checkpoint, data


def median_iteration_s(save: Path, nproc: int, args: list[str], iters: int) -> float:
    """Train `iters` iterations of global batch 8 (micro batches of 4, seq 256) with the trainer options
    `args` into `save`; the median iteration time after the first 5, from its metrics.jsonl."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=29561",
               str(REPO / "scripts/train/pretrain_llava.py"), "--save", "--save-dir", str(save),
               "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length", "256",
               "--num-workers", "0", "--train-iters", str(iters), *args]
    subprocess.run(command, check=True, capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    times = [json.loads(line)["iteration_time_s"] for line in (save / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    return statistics.median(times[5:])


@click.command()
@click.option("--iters", type=int, default=40, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None)
def main(iters, workdir):
    work = Path(workdir or tempfile.mkdtemp(prefix="train-bench-"))
    checkpoint, data = prepare(work)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    print("| layout | processes | median iteration (s) | samples/s |")
    print("|---|---|---|---|")
    for name, (nproc, extra) in LAYOUTS.items():
        seconds = median_iteration_s(work / f"run-{name}", nproc, ["--megatron-load-dir", str(checkpoint), "--data-path",
                                     str(data), "--stage", "2", "--lr", "1e-4", *extra], iters)
        print(f"| {name} | {nproc} | {seconds:.3f} | {8 / seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
