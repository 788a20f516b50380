"""megatron-ext-demo: the tiny end-to-end demo on CPU, and the tiny random models it starts from.

    megatron-ext-demo run [--output-dir demo_output]
    megatron-ext-demo tiny-models --save-dir DIR [--text-arch MODEL_TYPE] [--tie-word-embeddings]

(scripts/demo/run_demo.py and make_tiny_hf_models.py run the same commands.)
"""

import json
import time
from pathlib import Path

import click

from megatron_ext.demo.pipeline import DemoSettings
from megatron_ext.demo.tiny_presets import DEFAULT_TEXT_ARCH, TEXT_PRESETS
from megatron_ext.errors import run_command


@click.command("run")
@click.option("--output-dir", type=click.Path(file_okay=False), default="demo_output", show_default=True,
              help="Where every artifact of the demo goes (reused and overwritten).")
@click.option("--stage1-iters", type=int, default=DemoSettings.stage1_iters, show_default=True,
              help="Stage 1 training iterations.")
@click.option("--stage2-iters", type=int, default=DemoSettings.stage2_iters, show_default=True,
              help="Stage 2 training iterations (fewer: faster, worse answers).")
@click.option("--dpo-iters", type=int, default=DemoSettings.dpo_iters, show_default=True,
              help="DPO iterations on the preference pairs.")
def demo(output_dir, stage1_iters, stage2_iters, dpo_iters):
    """Build, convert, prepare data, train (stage 1 + 2, TP2), convert back, answer a question about an
    image, evaluate on the val split and tune on preference pairs (DPO), each step the command a user types."""
    from megatron_ext.demo.pipeline import first_sample, held_out_rewards, run_demo
    from megatron_ext.logs import setup_logging

    setup_logging()
    start = time.perf_counter()
    out = Path(output_dir).resolve()
    paths = run_demo(out, DemoSettings(stage1_iters=stage1_iters, stage2_iters=stage2_iters,
                                         dpo_iters=dpo_iters))

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

    before, after = held_out_rewards(paths["DPO checkpoints"])
    print(f"\n==> DPO on {after['pairs']} held-out (val) pairs, before and after {after['iteration']} iterations "
          "(rewards: beta x log-ratio to the stage 2 reference)")
    for name, record in (("before", before), ("after", after)):
        print(f"{name:6s}  rewards/accuracies {record['rewards/accuracies']:.3f}  "
              f"rewards/margins {record['rewards/margins']:.4f}  loss {record['loss']:.4f}")

    print("\nartifacts:")
    for name, path in paths.items():
        print(f"  {name:28s} {path}")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")


@click.command("tiny-models")
@click.option("--save-dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--text-arch", type=click.Choice(sorted(TEXT_PRESETS)), default=DEFAULT_TEXT_ARCH, show_default=True,
              help="Text family (HF model_type) of the tiny text model.")
@click.option("--tie-word-embeddings", is_flag=True, help="Share the input embedding with the LM head.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty --save-dir.")
def tiny_models(save_dir, text_arch, tie_word_embeddings, seed, force):
    """Write tiny random Hugging Face models (a text model with a locally trained tokenizer, CLIP and
    SigLIP towers) for tests and the CPU demo. Nothing is downloaded."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_all
    from megatron_ext.fsutil import atomic_output_dir, check_output_dir
    from megatron_ext.logs import setup_logging

    setup_logging()
    save_dir = check_output_dir(save_dir, force, "--save-dir")
    spec = TinyTextSpec(arch=text_arch, tie_word_embeddings=tie_word_embeddings)
    with atomic_output_dir(save_dir) as tmp:
        made = make_all(Path(tmp), spec, seed)
    for name in made:
        click.echo(f"{name}: {save_dir / name}")


group = click.Group("megatron-ext-demo", help=__doc__.split("\n")[0], commands=[demo, tiny_models])


def main() -> None:
    run_command(group)


if __name__ == "__main__":
    main()
