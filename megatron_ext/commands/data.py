"""megatron-ext-data: prepared energon datasets from LLaVA JSON / JSONL, and a synthetic one to try.

    megatron-ext-data build INPUT --output-dir OUT [--image-root DIR] [--split-ratio 9,1,0] [--task sft|preference]
    megatron-ext-data synthetic --output-dir D [--num-samples N] [--lang en|ja] [--task sft|preference]
    megatron-ext-data inspect DATA --megatron-load-dir CKPT [--samples N] [--all] [--output page.html]

(scripts/data/build_energon_dataset.py, make_synthetic_dataset.py and inspect_dataset.py run the same commands.)
"""

import logging

import click

from megatron_ext.data.image_aspects import IMAGE_ASPECTS
from megatron_ext.data.tasks import SFT, TASKS
from megatron_ext.demo.synthetic_data import SyntheticSpec
from megatron_ext.errors import run_command
from megatron_ext.progress import quiet_option


@click.command("build")
@quiet_option
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Directory for the prepared dataset.")
@click.option("--image-root", type=click.Path(file_okay=False), help="Folder the records' image paths are relative to (default: INPUT's folder).")
@click.option("--split-ratio", default="9,1,0", show_default=True, help="train,val,test shares of the records, in input order (train first); every non-zero share gets at least one.")
@click.option("--samples-per-shard", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--num-workers", type=click.IntRange(min=0), default=4, show_default=True, help="Processes that check and encode images.")
@click.option("--strict", is_flag=True, help="Fail on the first bad sample instead of skipping it.")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
@click.option("--task", type=click.Choice(TASKS), default=SFT, show_default=True,
              help="sft: conversations; preference: chosen/rejected pairs for DPO (LLaVA conversations with "
              "rejected_conversations or chosen/rejected, RLAIF-V rows, or TRL prompt/chosen/rejected/images).")
@click.option("--tokenizer-load-dir", type=click.Path(), help="With --seq-length, --task preference: skip pairs whose "
              "prompt alone reaches --seq-length tokens of this HF tokenizer (a rough count: the prompt's text "
              "without a chat template, plus one token per image or video).")
@click.option("--seq-length", type=click.IntRange(min=1), help="The sequence length the pairs are trained at (with --tokenizer-load-dir).")
def build(input_path, output_dir, image_root, split_ratio, samples_per_shard, num_workers, strict, force, task,
          tokenizer_load_dir, seq_length):
    """Build a prepared energon dataset from LLaVA conversation JSON or question/answer JSONL (text-only,
    one-image and multi-image conversations), or of preference pairs (--task preference); bad records
    are skipped and listed in OUT/build_report.json."""
    from megatron_ext.data.build import REPORT_FILE, build_energon_dataset
    from megatron_ext.logs import setup_logging

    setup_logging()
    report = build_energon_dataset(input_path, output_dir, image_root, split_ratio, samples_per_shard,
                                   num_workers, strict, force, task, tokenizer_load_dir, seq_length)
    click.echo(report.summary())
    click.echo(f"report: {report.output_dir}/{REPORT_FILE}")


@click.command("synthetic")
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Where to write llava.json and images/.")
@click.option("--num-samples", type=click.IntRange(min=1), default=SyntheticSpec.num_samples, show_default=True)
@click.option("--multi-turn-fraction", type=click.FloatRange(0, 1), default=SyntheticSpec.multi_turn_fraction, show_default=True,
              help="Fraction of samples with three question/answer turns.")
@click.option("--min-size", type=click.IntRange(min=8), default=SyntheticSpec.min_size, show_default=True, help="Smallest image side.")
@click.option("--max-size", type=click.IntRange(min=8), default=SyntheticSpec.max_size, show_default=True, help="Largest image side.")
@click.option("--lang", type=click.Choice(["en", "ja"]), default="en", show_default=True, help="Language of questions and answers.")
@click.option("--image-format", type=click.Choice(["jpg", "png"]), default="jpg", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--task", type=click.Choice(TASKS), default=SFT, show_default=True,
              help="preference: D/preference.json, the last question's true answer chosen and one with a wrong "
              "colour or shape rejected (build it with --task preference).")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
def synthetic(output_dir, num_samples, multi_turn_fraction, min_size, max_size, lang, image_format, seed, task, force):
    """Write a synthetic LLaVA conversation dataset (coloured shapes + questions) for demos and tests."""
    from megatron_ext.demo.synthetic_data import make_synthetic_dataset
    from megatron_ext.fsutil import check_output_dir

    check_output_dir(output_dir, force, "--output-dir")
    spec = SyntheticSpec(num_samples=num_samples, multi_turn_fraction=multi_turn_fraction, min_size=min(min_size, max_size),
                         max_size=max(min_size, max_size), lang=lang, image_format=image_format, seed=seed, task=task)
    path = make_synthetic_dataset(output_dir, spec)
    click.echo(f"wrote {num_samples} {'pairs' if task != SFT else 'samples'} to {path}")


@click.command("inspect")
@quiet_option
@click.argument("data", metavar="DATA", type=click.Path())
@click.option("--output", type=click.Path(dir_okay=False), default="sample_inspector.html", show_default=True,
              help="The HTML page to write.")
@click.option("--megatron-load-dir", type=click.Path(), help="The checkpoint whose inputs to show (its tokenizer, "
              "processor and, for a trained one, the data options it was trained with).")
@click.option("--tokenizer-load-dir", type=click.Path(), help="HF LLaVA directory (tokenizer, processor, config.json): "
              "instead of a checkpoint, or to override its tokenizer.")
@click.option("--split", default="train", show_default=True, help="Split of a prepared dataset.")
@click.option("--image-root", type=click.Path(file_okay=False), help="LLaVA JSON input: the folder its image paths are "
              "relative to (default: DATA's folder).")
@click.option("--samples", type=click.IntRange(min=1), default=8, show_default=True, help="Samples shown (drawn with --seed).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--keys", help="Show these samples instead (comma-separated keys, e.g. 000000012).")
@click.option("--all", "everything", is_flag=True, help="Count every sample of the split in the summary (else the shown ones).")
@click.option("--seq-length", type=click.IntRange(min=1), help="As the trainer's (default: the checkpoint's, else min(2048, model max)).")
@click.option("--packing-seq-length", type=click.IntRange(min=1), help="As the trainer's: show the packed rows.")
@click.option("--chat-template", help="As the trainer's: 'tokenizer', a bundled name or a .jinja file.")
@click.option("--lang", type=click.Choice(["en", "ja", "jp"]), help="As the trainer's (selects the default template).")
@click.option("--image-aspect", type=click.Choice(IMAGE_ASPECTS), help="As the trainer's (LLaVA-1.5 models).")
@click.option("--video-frames", type=click.IntRange(min=1), help="As the trainer's (tiled models).")
@click.option("--max-tiles-per-sequence", type=click.IntRange(min=1), help="As the trainer's.")
def inspect(data, output, megatron_load_dir, tokenizer_load_dir, split, image_root, samples, seed, keys, everything,
            **options):
    """Write one self-contained HTML page of what the model sees of DATA (a prepared energon dataset or
    metadataset YAML, or LLaVA JSON / JSONL before it is prepared) through the trainer's task encoder:
    images as the model gets them, tokens by role with the trained ones marked, lengths, packing."""
    from megatron_ext.logs import setup_logging
    from megatron_ext.pages.inspector_page import write_inspection
    from megatron_ext.pages.sample_encoding import EncoderSetup
    from megatron_ext.pages.sample_sources import Selection

    setup_logging()
    # How the encoder preprocesses is on the page; on the terminal it would only hide an error line.
    logging.getLogger("megatron_ext.data").setLevel(logging.WARNING)
    keys = tuple(k.strip() for k in keys.split(",") if k.strip()) if keys else ()
    selection = Selection(samples=len(keys) or samples, seed=seed, keys=keys, everything=everything)
    setup = EncoderSetup(megatron_load_dir, tokenizer_load_dir, options)
    page = write_inspection(data, output, setup, selection, split, image_root)
    click.echo(f"wrote {page}")


group = click.Group("megatron-ext-data", help=__doc__.split("\n")[0], commands=[build, synthetic, inspect])


def main() -> None:
    run_command(group)


if __name__ == "__main__":
    main()
