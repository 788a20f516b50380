"""Does our trainer on this machine train the model transformers would? The parity check
(`megatron_ext/verify/parity.py`, what `megatron-ext-parity` runs) on a small random LLaVA-1.5
(Llama-GQA + CLIP) and a synthetic dataset, both built here, in several settings on one device.

    python bench/parity_bench.py --out bench/results/parity-gpu.md       # on a GPU: bf16 and fp32
    python bench/parity_bench.py --steps 2 --small                       # the same on a CPU (fp32)

On a GPU "auto" is bf16 (megatron-core's bf16 weights and fp32 master copies against transformers'
fp32 weights under autocast, as its Trainer's `bf16=True`); the fp32 case shows what is left when
both sides compute in fp32 there. Each case prints the check's table; the report lists, per case,
the largest relative difference of losses and gradient norms over the steps, the largest trained
weight difference and whether the frozen parameters are bit-identical.
"""

from __future__ import annotations

import platform
import sys
import tempfile
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASE = {"stage": 2, "lr": 1e-4, "weight_decay": 0.1, "seq_length": 512, "micro_batch_size": 2,
        "global_batch_size": 8}
CASES = {  # name: trainer options over BASE
    "auto dtype, stage 2, micro batches of 2": {},
    "auto dtype, stage 2, packed micro batches of 1 (THD)": {"micro_batch_size": 1, "packing_seq_length": 512},
    "auto dtype, stage 1": {"stage": 1},
    "fp32, stage 2, micro batches of 2": {"dtype": "float32"},
}


def build_inputs(work: Path, small: bool) -> tuple[Path, Path]:
    """A random LLaVA-1.5 (hidden 512, 4 layers, 8 / 4 heads; CLIP hidden 256, 4 layers; with --small:
    the tests' tiny sizes) and 64 synthetic samples prepared as an energon dataset."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset
    from megatron_ext.demo.tiny_models import TinyTextSpec, TinyVisionSpec, make_text_model, make_vision_model
    from megatron_ext.hf.build_llava import build_llava

    text = TinyTextSpec() if small else TinyTextSpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                                                      intermediate_size=1408, initializer_range=0.02)
    vision = TinyVisionSpec() if small else TinyVisionSpec(hidden_size=256, num_layers=4, num_heads=4,
                                                           intermediate_size=1024)
    hf = build_llava(work / "hf", str(make_text_model(work / "text", text)),
                     str(make_vision_model(work / "vision", "clip", vision)))
    source = make_synthetic_dataset(work / "source", SyntheticSpec(num_samples=64, seed=5))
    data = work / "energon"
    build_energon_dataset(source, data, split_ratio="10,0,0", samples_per_shard=16, num_workers=0)
    return hf, data


def summary(name: str, report) -> str:
    loss = max(r.rel[0] for r in report.rows)
    grad = max(r.rel[1] for r in report.rows)
    trained = max(d for d, t in report.modules.values() if t)
    frozen = "yes" if not any(p.startswith("frozen") for p in report.problems) else "NO"
    verdict = "ok" if report.ok else "FAIL"
    return (f"| {name} | {report.dtype} | {loss:.1e} | {grad:.1e} | {trained:.1e} (bound {report.weight_atol:.1e}) | "
            f"{frozen} | {verdict} (rtol {report.rtol:g}) |")


@click.command()
@click.option("--steps", default=4, show_default=True, help="Optimizer steps per case.")
@click.option("--small", is_flag=True, help="The tests' tiny model instead of hidden 512.")
@click.option("--case", "cases", multiple=True, type=click.Choice(list(CASES)), help="Only these (repeatable).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, help="Keep the models and runs here.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the report (markdown) here.")
def main(steps, small, cases, work_dir, out):
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.verify.parity import check_parity

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'})"
    lines = [f"Device: {device}; torch {torch.__version__}; {steps} steps per case; options over {BASE}.", "",
             "| case | dtype | loss rel. diff (max) | grad norm rel. diff (max) | trained weights max abs diff | "
             "frozen bit-identical | verdict |", "|---|---|---:|---:|---:|---|---|"]
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as tmp:
        work = Path(work_dir or tmp)
        hf, data = build_inputs(work, small)
        megatron = convert(hf, work / "megatron", tp=1, pp=1, force=True)
        for i, name in enumerate(cases or CASES):
            print(f"== {name}", flush=True)
            (work / f"case{i}").mkdir(parents=True, exist_ok=True)
            report = check_parity(hf, str(data), work / f"case{i}", steps, 1, {**BASE, **CASES[name]},
                                  megatron_dir=megatron)
            print(report.table(), flush=True)
            lines.append(summary(name, report))
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
