"""CPU time per preference pair of --stage dpo against time per sample of stage 2 (the trainer, end to end).

    python bench/dpo_bench.py [--iters 30] [--workdir DIR]

The tiny demo model (train_bench.py's: Llama 2x64 GQA + CLIP 2x32, 56x56 images, converted at TP1)
on 256 synthetic samples and the 256 preference pairs about the same pictures, one process, fp32,
seq 256, global batch 8 (2 micro batches of 4 samples or 4 pairs). Runs stage 2, DPO with the live
reference (a frozen copy runs forward on every step) and DPO with --reference-logprobs precompute
(one forward pass over the train split before the first step, outside the iteration times), and
reports each run's median iteration time after the first 5 iterations, from its metrics.jsonl, and
the run's wall time (start-up, the precompute pass and the final save included).
"""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

import click
from train_bench import median_iteration_s, prepare

BATCH = 8
RUNS = {  # name: (trained on pairs, trainer options)
    "stage 2 (SFT)": (False, ["--stage", "2", "--lr", "1e-4"]),
    "DPO, live reference": (True, ["--stage", "dpo", "--lr", "1e-5"]),
    "DPO, precomputed reference": (True, ["--stage", "dpo", "--lr", "1e-5", "--reference-logprobs", "precompute"]),
}


def _pairs(work: Path) -> Path:
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.data.tasks import PREFERENCE
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(work / "pairs-src", SyntheticSpec(num_samples=256, task=PREFERENCE))
    data = work / "pairs"
    build_energon_dataset(source, data, split_ratio="9,1,0", samples_per_shard=16, num_workers=0, task=PREFERENCE)
    return data


@click.command()
@click.option("--iters", type=int, default=30, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None)
def main(iters, workdir):
    work = Path(workdir or tempfile.mkdtemp(prefix="dpo-bench-"))
    checkpoint, samples = prepare(work)
    pairs = _pairs(work)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    print("| run | median iteration (s) | s per sample or pair | vs stage 2 | run wall (s) |")
    print("|---|---:|---:|---:|---:|")
    sft = None
    for i, (name, (on_pairs, args)) in enumerate(RUNS.items()):
        data = pairs if on_pairs else samples
        start = time.perf_counter()
        seconds = median_iteration_s(work / f"run-{i}", 1, ["--megatron-load-dir", str(checkpoint), "--data-path",
                                                           str(data), *args], iters)
        wall = time.perf_counter() - start
        sft = sft or seconds
        print(f"| {name} | {seconds:.3f} | {seconds / BATCH:.4f} | {seconds / sft:.2f}x | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
