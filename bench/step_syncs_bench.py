"""Device -> host reads and collectives per training step, at 2 and 4 language-model layers.

    python bench/step_syncs_bench.py [--iters 2] [--micro-batches 4] [--tp 1]

Each read of a device tensor's values on the host stalls the CPU until a GPU has finished the work
queued before it; each collective is a launch and, over NCCL, a wait on the other ranks. Both
should be counted per step, never per layer. No GPU is needed to count them: the trainer
(`scripts/train/pretrain_llava.py`) runs under the GPU rehearsal (`tests/train/gpu_rehearsal.py`),
whose ledger records every read by call site and every collective by name, on tiny random
LLaVA-1.5 models (CLIP + GQA Llama) that differ only in their number of layers. Stage 2, sdpa,
bf16, packed THD rows (micro batch 1), `--tp` processes (rank 0's counts). Each model runs `--iters`
and twice as many steps; the difference, per step, leaves out start-up. Prints a Markdown table per kind, then a JSON line:
{"reads": {site: [per step at 2 layers, at 4]}, "collectives": {...}}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
LAYERS = (2, 4)


def checkpoints(root: Path) -> dict[int, Path]:
    """A Megatron checkpoint of the same tiny LLaVA at each of LAYERS language-model layers."""
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model, make_vision_model
    from megatron_ext.hf.build_llava import build_llava

    vision = make_vision_model(root / "vision", "clip")
    made = {}
    for layers in LAYERS:
        text = make_text_model(root / f"text{layers}", TinyTextSpec(num_layers=layers))
        hf = build_llava(root / f"hf{layers}", str(text), str(vision))
        made[layers] = convert(hf, root / f"megatron{layers}", tp=1, pp=1)
    return made


def dataset(root: Path) -> Path:
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(root / "source", SyntheticSpec(num_samples=48, seed=3))
    build_energon_dataset(source, root / "energon", split_ratio="1,0,0", samples_per_shard=8, num_workers=0)
    return root / "energon"


def rehearsed_run(checkpoint: Path, data: Path, out: Path, iters: int, micro_batches: int, tp: int) -> dict:
    out.mkdir(parents=True)
    report = out / "report.json"
    args = ["--megatron-load-dir", checkpoint, "--data-path", data, "--save-dir", out / "run", "--stage", "2",
            "--micro-batch-size", "1", "--global-batch-size", str(micro_batches), "--seq-length", "128",
            "--packing-seq-length", "128", "--train-iters", str(iters), "--log-interval", str(iters),
            "--num-workers", "0", "--lr", "1e-3", "--dtype", "bfloat16", "--attention-backend", "sdpa", "--tp", str(tp)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "REHEARSAL_REPORT": str(report),
           "REHEARSAL_MATH_LIMIT": "0", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
                    str(REPO / "tests/train/gpu_rehearsal.py"), str(REPO / "scripts/train/pretrain_llava.py"),
                    *map(str, args)], check=True, env=env, capture_output=True, timeout=900)
    return json.loads(report.read_text())


def _site(entry: str) -> str:
    """file (function), without the line number."""
    path, _, rest = entry.partition(":")
    return f"{path} {rest.partition(' ')[2]}"


def _by_name(counts: dict[str, int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for name, n in counts.items():
        key = _site(name) if ":" in name else name  # reads are keyed file:line (function)
        totals[key] = totals.get(key, 0) + n
    return totals


def per_step(short: dict[str, int], long: dict[str, int], iters: int) -> dict[str, float]:
    """What `iters` more steps add, per step: start-up and the last step's logging cancel out."""
    short, long = _by_name(short), _by_name(long)
    return {name: (long.get(name, 0) - short.get(name, 0)) / iters for name in set(short) | set(long)
            if long.get(name, 0) != short.get(name, 0)}


@click.command()
@click.option("--iters", type=int, default=2, show_default=True, help="Training steps per run.")
@click.option("--micro-batches", type=int, default=4, show_default=True, help="Micro batches per step.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size (= processes).")
def main(iters: int, micro_batches: int, tp: int):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = dataset(root)
        runs = {(layers, n): rehearsed_run(checkpoint, data, root / f"run{layers}-{n}", n, micro_batches, tp)
                for layers, checkpoint in checkpoints(root).items() for n in (iters, 2 * iters)}
    result = {}
    for kind in ("reads", "collectives"):
        rows = {layers: per_step(runs[layers, iters][kind], runs[layers, 2 * iters][kind], iters) for layers in LAYERS}
        names = sorted(set().union(*rows.values()))
        result[kind] = {name: [rows[layers].get(name, 0) for layers in LAYERS] for name in names}
        print(f"\n| {kind} per step ({micro_batches} micro batches, TP{tp}) | " + " | ".join(f"{n} layers" for n in LAYERS) + " |")
        print("|---|" + "---:|" * len(LAYERS))
        for name, counts in result[kind].items():
            print(f"| {name} | " + " | ".join(f"{c:g}" for c in counts) + " |")
        print("| total | " + " | ".join(f"{sum(rows[n].values()):g}" for n in LAYERS) + " |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
