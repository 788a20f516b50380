"""megatron-ext-generate, -chat, -evaluate, -benchmark: a Megatron (any TP x PP, under torchrun) or
Hugging Face LLaVA checkpoint answers prompts, chats, is scored on a dataset split, or on lmms-eval tasks.

    megatron-ext-generate --megatron-dir D --image cat.jpg --prompt "What is this?"
    megatron-ext-generate --hf-dir D --input-jsonl requests.jsonl --output-jsonl answers.jsonl
    megatron-ext-chat --megatron-dir D --image cat.jpg   (or --video clip.mp4)
    megatron-ext-evaluate --megatron-dir D --data-path DATA --output-dir OUT [--split test] [--fast-n 50]
    megatron-ext-benchmark --hf-dir D --tasks textvqa_val,scienceqa_img --output-dir OUT [--limit 100]
    torchrun --nproc-per-node 2 -m megatron_ext.commands.eval generate --megatron-dir D --tp 2 ...

(scripts/eval/generate.py, chat.py, evaluate.py and benchmark.py run the same commands.)
"""

import functools
import sys

import click

from megatron_ext.errors import run_command
from megatron_ext.eval.cli_options import checkpoint_options, make_sampling, sampling_options, video_frames_option
from megatron_ext.progress import quiet_option


@click.command("generate")
@quiet_option
@checkpoint_options
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="Image the prompt is about; repeat for several (placed by <image> in the prompt, else before it).")
@click.option("--video", "videos", multiple=True, type=click.Path(dir_okay=False),
              help="Video the prompt is about (LLaVA-OneVision, Qwen2.5-VL); repeat for several (placed by <video>, else before the prompt).")
@video_frames_option
@click.option("--prompt", help="The question or instruction.")
@click.option("--input-jsonl", type=click.Path(dir_okay=False),
              help="Batch mode: one {\"image\", \"video\", \"prompt\"} per line.")
@click.option("--output-jsonl", type=click.Path(dir_okay=False), help="Write the answers here (default: stdout).")
@sampling_options(default_max_new_tokens=128)
def generate(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, images, videos, video_frames, prompt,
             input_jsonl, output_jsonl, max_new_tokens, temperature, top_p, seed):
    """Answer prompts about images: greedy by default (--temperature 0), up to the end-of-turn token or
    --max-new-tokens; one prompt is streamed to the terminal, --input-jsonl lines are {"image", "video", "prompt", "id"}."""
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.eval.request_file import generate_answers
    from megatron_ext.logs import setup_logging

    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = open_checkpoint(megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        generate_answers(source, options, tp=tp, pp=pp, images=images, prompt=prompt, input_jsonl=input_jsonl,
                         output_jsonl=output_jsonl, videos=videos, video_frames=video_frames)
    finally:
        shutdown()


@click.command("chat")
@checkpoint_options
@click.option("--image", type=click.Path(dir_okay=False), help="Image to talk about (or /image PATH later).")
@click.option("--video", type=click.Path(dir_okay=False),
              help="Video to talk about instead (LLaVA-OneVision, Qwen2.5-VL; or /video PATH later).")
@video_frames_option
@sampling_options(default_max_new_tokens=256)
def chat(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, image, video, video_frames, max_new_tokens,
         temperature, top_p, seed):
    """Chat about an image or a video in the terminal: /image PATH or /video PATH switches to another
    (new conversation), /reset forgets the conversation, /exit quits."""
    from megatron_ext.distributed import shutdown
    from megatron_ext.errors import UserError
    from megatron_ext.eval.chat import run_chat
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.logs import setup_logging

    if image and video:  # before the checkpoint opens: refused at once
        raise UserError("give --image or --video, not both: a conversation is about one image or one video")
    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = open_checkpoint(megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        run_chat(source, options, tp=tp, pp=pp, image=image, video=video, video_frames=video_frames)
    finally:
        shutdown()


@click.command("evaluate")
@quiet_option
@checkpoint_options
@click.option("--data-path", required=True, type=click.Path(), help="Prepared energon dataset (or metadataset YAML).")
@click.option("--split", type=click.Choice(["val", "test"]), default="val", show_default=True, help="Split to evaluate on.")
@click.option("--fast-n", type=int, help="Only the first K samples of the split (a quick check).")
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Where predictions.jsonl and metrics.json go.")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
@click.option("--seq-length", type=int, help="Truncate samples for the loss as the trainer does (default: the trained --seq-length, else the model's context).")
@sampling_options(default_max_new_tokens=64)
def evaluate(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, data_path, split, fast_n, output_dir, force,
             seq_length, max_new_tokens, temperature, top_p, seed):
    """Score a checkpoint on a prepared dataset's val or test split: OUT/predictions.jsonl, OUT/metrics.json
    (loss and perplexity for Megatron checkpoints; exact match, BLEU, ROUGE-L, CIDEr) and a table."""
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.eval.evaluation import run_evaluation
    from megatron_ext.logs import setup_logging

    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = functools.partial(open_checkpoint, megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        run_evaluation(source, options, data_path=data_path, split=split, fast_n=fast_n, output_dir=output_dir,
                       force=force, tp=tp, pp=pp, seq_length=seq_length)
    finally:
        shutdown()


@click.command("benchmark")
@quiet_option
@checkpoint_options
@click.option("--tasks", required=True, help="Comma-separated lmms-eval task names, e.g. textvqa_val,mmmu_val,scienceqa_img.")
@click.option("--include-path", type=click.Path(file_okay=False), help="Directory of extra task YAMLs (local datasets).")
@click.option("--limit", type=int, help="Only the first N samples of each task (a quick check).")
@click.option("--output-dir", required=True, type=click.Path(file_okay=False),
              help="Where lmms-eval's results and per-sample logs and summary.json go.")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
@click.option("--tensorboard-dir", type=click.Path(file_okay=False), help="Also log the scores to TensorBoard here.")
@click.option("--wandb-project", help="Also log the scores to this Weights & Biases project.")
@video_frames_option
def benchmark(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, tasks, include_path, limit, output_dir,
              force, tensorboard_dir, wandb_project, video_frames):
    """Score a checkpoint on lmms-eval tasks (its prompts and scorers): lmms-eval's result files and
    per-sample logs plus OUT/summary.json, and a table. HF LLaVA checkpoints run in lmms-eval's llava_hf model,
    HF Qwen-VL ones in transformers' generate on the trainer's prompt encoding; Megatron ones directly at any
    TP x PP: --tp/--pp above 1 start their ranks here (or run under torchrun)."""
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.benchmark import run_benchmark
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.launch import own_ranks
    from megatron_ext.logs import setup_logging

    ranks = (tp or 1) * (pp or 1)
    if megatron_dir and ranks > 1 and not own_ranks.under_torchrun():
        # This command's own arguments: what follows the program (benchmark.py, megatron-ext-benchmark) or the group's
        # command name (python -m megatron_ext.commands.eval benchmark).
        args = sys.argv[2:] if sys.argv[1:2] == ["benchmark"] else sys.argv[1:]
        return own_ranks.start(ranks, "megatron_ext.commands.eval", ["benchmark", *args])
    own_ranks.rank_started()
    setup_logging()
    source = functools.partial(open_checkpoint, megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        run_benchmark(source, tasks=[t for t in tasks.split(",") if t], include_path=include_path, output_dir=output_dir,
                      force=force, limit=limit, tp=tp, pp=pp, tensorboard_dir=tensorboard_dir, wandb_project=wandb_project,
                      video_frames=video_frames)
    finally:
        shutdown()


group = click.Group("megatron-ext-eval", help=__doc__.split("\n")[0], commands=[generate, chat, evaluate, benchmark])


def generate_main() -> None:
    run_command(generate)


def chat_main() -> None:
    run_command(chat)


def evaluate_main() -> None:
    run_command(evaluate)


def benchmark_main() -> None:
    run_command(benchmark)


if __name__ == "__main__":
    run_command(group)
