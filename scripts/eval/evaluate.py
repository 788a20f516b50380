"""Evaluate a Megatron or Hugging Face LLaVA checkpoint on a prepared dataset's val or test split.

    python scripts/eval/evaluate.py --megatron-dir D --data-path DATA --output-dir OUT [--split test] [--fast-n 50]
    torchrun --nproc-per-node 2 scripts/eval/evaluate.py --megatron-dir D --tp 2 --data-path DATA --output-dir OUT

Writes OUT/predictions.jsonl (one generated answer per sample) and OUT/metrics.json (loss and
perplexity for Megatron checkpoints; exact match, BLEU, ROUGE-L and CIDEr), and prints a table.
"""

import click

from megatron_ext.errors import run_command
from megatron_ext.eval.cli_options import checkpoint_options, make_sampling, sampling_options
from megatron_ext.progress import quiet_option


@click.command()
@quiet_option
@checkpoint_options
@click.option("--data-path", required=True, type=click.Path(), help="Prepared energon dataset (or metadataset YAML).")
@click.option("--split", type=click.Choice(["val", "test"]), default="val", show_default=True, help="Split to evaluate on.")
@click.option("--fast-n", type=int, help="Only the first K samples of the split (a quick check).")
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Where predictions.jsonl and metrics.json go.")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
@click.option("--seq-length", type=int, help="Truncate samples for the loss as the trainer does (default: the trained --seq-length, else the model's context).")
@sampling_options(default_max_new_tokens=64)
def main(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, data_path, split, fast_n, output_dir, force, seq_length,
         max_new_tokens, temperature, top_p, seed):
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.eval.evaluation import run_evaluation
    from megatron_ext.logs import setup_logging

    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = open_checkpoint(megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        run_evaluation(source, options, data_path=data_path, split=split, fast_n=fast_n, output_dir=output_dir,
                       force=force, tp=tp, pp=pp, seq_length=seq_length)
    finally:
        shutdown()


if __name__ == "__main__":
    run_command(main)
