"""The tiny end-to-end demo on CPU: build, convert, prepare data, train (stage 1 + 2, TP2), convert
back, answer a question about an image and evaluate on the val split.

    python scripts/demo/run_demo.py [--output-dir demo_output]
"""

import json
import time
from pathlib import Path

import click

from megatron_ext.demo import DemoSettings, first_sample, run_demo
from megatron_ext.errors import run_command
from megatron_ext.logs import setup_logging


@click.command()
@click.option("--output-dir", type=click.Path(file_okay=False), default="demo_output", show_default=True,
              help="Where every artifact of the demo goes (reused and overwritten).")
@click.option("--stage1-iters", type=int, default=DemoSettings.stage1_iters, show_default=True,
              help="Stage 1 training iterations.")
@click.option("--stage2-iters", type=int, default=DemoSettings.stage2_iters, show_default=True,
              help="Stage 2 training iterations (fewer: faster, worse answers).")
def main(output_dir, stage1_iters, stage2_iters):
    setup_logging()
    start = time.perf_counter()
    out = Path(output_dir).resolve()
    paths = run_demo(out, DemoSettings(stage1_iters=stage1_iters, stage2_iters=stage2_iters))

    image, question, reference = first_sample(paths["synthetic dataset"])
    answer = json.loads(paths["answer (generate.py)"].read_text().splitlines()[0])
    print("\n==> what the trained model answers (scripts/eval/generate.py, HF checkpoint)")
    print(f"image:     {image}")
    print(f"question:  {question}")
    print(f"reference: {reference}")
    print(f"answer:    {answer['answer']}")

    scores = json.loads((paths["evaluation (evaluate.py)"] / "metrics.json").read_text())
    print(f"\n==> scores on {scores['samples']} val samples (scripts/eval/evaluate.py, Megatron checkpoint)")
    print("  ".join(f"{name} {scores[name]:.3f}" for name in ("loss", "perplexity", "exact_match", "bleu", "rouge_l",
                                                              "cider")))

    print("\nartifacts:")
    for name, path in paths.items():
        print(f"  {name:28s} {path}")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    run_command(main)
