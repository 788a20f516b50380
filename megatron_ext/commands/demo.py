"""megatron-ext-demo: the tiny end-to-end demo on CPU, and the tiny random models it starts from.

    megatron-ext-demo run [--output-dir demo_output] [--family qwen2_5_vl|qwen3_vl]
    megatron-ext-demo tiny-models --save-dir DIR [--text-arch MODEL_TYPE] [--tie-word-embeddings]
    megatron-ext-demo tiny-qwen-vl --save-dir DIR [--family qwen2_5_vl|qwen3_vl]
    megatron-ext-demo answer --hf-dir QWEN_VL --image IMG --prompt TEXT --output-jsonl OUT

(scripts/demo/run_demo.py and make_tiny_hf_models.py run the same commands.)
"""

import dataclasses
import json
import time
from pathlib import Path

import click

from megatron_ext.demo.pipeline import QWEN_VL_DEMOS, QWEN_VL_SETTINGS, DemoSettings
from megatron_ext.demo.tiny_presets import DEFAULT_TEXT_ARCH, TEXT_PRESETS
from megatron_ext.errors import run_command

FAMILIES = ("llava", *QWEN_VL_DEMOS)  # what the demo runs: the LLaVA pipeline, or a native-resolution model


@click.command("run")
@click.option("--output-dir", type=click.Path(file_okay=False), default="demo_output", show_default=True,
              help="Where every artifact of the demo goes (reused and overwritten).")
@click.option("--stage1-iters", type=int, default=DemoSettings.stage1_iters, show_default=True,
              help="Stage 1 training iterations.")
@click.option("--stage2-iters", type=int, default=None,
              help=f"Stage 2 training iterations (fewer: faster, worse answers) [default: {DemoSettings.stage2_iters}; "
                   f"{QWEN_VL_SETTINGS.stage2_iters} with a Qwen-VL --family]")
@click.option("--dpo-iters", type=int, default=DemoSettings.dpo_iters, show_default=True,
              help="DPO iterations on the preference pairs.")
@click.option("--family", type=click.Choice(FAMILIES), default=FAMILIES[0], show_default=True,
              help="qwen2_5_vl, qwen3_vl: a tiny native-resolution Qwen2.5-VL or Qwen3-VL converted (TP2), trained "
                   "in stage 2 and converted back, answering with transformers' generate.")
def demo(output_dir, stage1_iters, stage2_iters, dpo_iters, family):
    """Build, convert, prepare data, train (stage 1 + 2, TP2), convert back, answer a question about an
    image, evaluate on the val split and tune on preference pairs (DPO), each step the command a user types."""
    from megatron_ext.logs import setup_logging

    setup_logging()
    start = time.perf_counter()
    out = Path(output_dir).resolve()
    if family in QWEN_VL_DEMOS:
        _qwen_demo(out, family, stage2_iters or QWEN_VL_SETTINGS.stage2_iters)
    else:
        _llava_demo(out, stage1_iters, stage2_iters or DemoSettings.stage2_iters, dpo_iters)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")


def _qwen_demo(out: Path, family: str, stage2_iters: int) -> None:
    from megatron_ext.demo.pipeline import run_qwen_vl_demo

    paths = run_qwen_vl_demo(out, family, dataclasses.replace(QWEN_VL_SETTINGS, stage2_iters=stage2_iters))
    _print_answer(paths["synthetic dataset"], paths["answer (transformers)"], "transformers' generate")
    _print_artifacts(paths)


def _print_answer(dataset: Path, answers: Path, how: str) -> None:
    from megatron_ext.demo.pipeline import first_sample

    image, question, reference = first_sample(dataset)
    answer = json.loads(answers.read_text().splitlines()[0])
    print(f"\n==> what the trained model answers ({how}, HF checkpoint)")
    print(f"image:     {image}")
    print(f"question:  {question}")
    print(f"reference: {reference}")
    print(f"answer:    {answer['answer']}")


def _print_artifacts(paths: dict) -> None:
    print("\nartifacts:")
    for name, path in paths.items():
        print(f"  {name:28s} {path}")


def _llava_demo(out: Path, stage1_iters: int, stage2_iters: int, dpo_iters: int) -> None:
    from megatron_ext.demo.pipeline import held_out_rewards, run_demo

    paths = run_demo(out, DemoSettings(stage1_iters=stage1_iters, stage2_iters=stage2_iters, dpo_iters=dpo_iters))
    _print_answer(paths["synthetic dataset"], paths["answer (generate.py)"], "scripts/eval/generate.py")

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
    _print_artifacts(paths)


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


@click.command("tiny-qwen-vl")
@click.option("--save-dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--family", type=click.Choice(list(QWEN_VL_DEMOS)), default="qwen2_5_vl", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty --save-dir.")
def tiny_qwen_vl(save_dir, family, seed, force):
    """Write a tiny random Qwen2.5-VL or Qwen3-VL (config, weights, a locally trained byte-level BPE
    tokenizer in ChatML's format) for the demo. Nothing is downloaded."""
    from megatron_ext.demo.tiny_models import make_qwen_vl
    from megatron_ext.fsutil import atomic_output_dir, check_output_dir
    from megatron_ext.logs import setup_logging

    setup_logging()
    save_dir = check_output_dir(save_dir, force, "--save-dir")
    with atomic_output_dir(save_dir) as tmp:
        make_qwen_vl(Path(tmp), family, seed)
    click.echo(f"{family}: {save_dir}")


@click.command("answer")
@click.option("--hf-dir", required=True, type=click.Path(), help="An HF Qwen2.5-VL or Qwen3-VL checkpoint.")
@click.option("--image", required=True, type=click.Path(), help="The image the question is about.")
@click.option("--prompt", required=True, help="The question.")
@click.option("--max-new-tokens", type=int, default=DemoSettings.max_new_tokens, show_default=True)
@click.option("--output-jsonl", required=True, type=click.Path(dir_okay=False), help="Where the answer is written.")
def answer(hf_dir, image, prompt, max_new_tokens, output_jsonl):
    """Answer one question about an image with an HF Qwen-VL checkpoint and transformers' own
    generate (greedy)."""
    from megatron_ext.demo.native_answer import greedy_answer
    from megatron_ext.fsutil import atomic_write_text

    text = greedy_answer(hf_dir, image, prompt, max_new_tokens)
    atomic_write_text(Path(output_jsonl), json.dumps({"image": str(image), "prompt": prompt, "answer": text}) + "\n")
    click.echo(f"answer: {text}")


group = click.Group("megatron-ext-demo", help=__doc__.split("\n")[0],
                    commands=[demo, tiny_models, tiny_qwen_vl, answer])


def main() -> None:
    run_command(group)


if __name__ == "__main__":
    main()
