"""Build a prepared megatron-energon dataset from LLaVA conversation JSON or question/answer JSONL.

    python scripts/data/build_energon_dataset.py INPUT --output-dir OUT [--image-root DIR]
        [--split-ratio 9,1,0] [--samples-per-shard N] [--num-workers N] [--strict]

INPUT is LLaVA JSON (a list of {"id", "image", "conversations": [{"from": "human"|"gpt", "value"}]};
"image" one file, a list of files with one <image> each, or absent for a text-only conversation) or
a .jsonl file of {"image", "question", "answer"} lines; image paths are relative to --image-root
(default: INPUT's folder). OUT gets NNNNNN.tar shards (KEY.jpg or KEY.png, KEY.0.jpg ... for several
images, KEY.txt, KEY.json), is prepared with `energon prepare`, and lists skipped samples in
OUT/build_report.json. OUT appears only when everything succeeded.
"""

import click

from megatron_ext.data.build import REPORT_FILE, build_energon_dataset
from megatron_ext.errors import run_command
from megatron_ext.logs import setup_logging
from megatron_ext.progress import quiet_option


@click.command()
@quiet_option
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False))
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Directory for the prepared dataset.")
@click.option("--image-root", type=click.Path(file_okay=False), help="Folder the records' image paths are relative to (default: INPUT's folder).")
@click.option("--split-ratio", default="9,1,0", show_default=True, help="train,val,test shares (energon splits by shard).")
@click.option("--samples-per-shard", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--num-workers", type=click.IntRange(min=0), default=4, show_default=True, help="Processes that check and encode images.")
@click.option("--strict", is_flag=True, help="Fail on the first bad sample instead of skipping it.")
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
def main(input_path, output_dir, image_root, split_ratio, samples_per_shard, num_workers, strict, force):
    setup_logging()
    report = build_energon_dataset(input_path, output_dir, image_root, split_ratio, samples_per_shard,
                                   num_workers, strict, force)
    click.echo(report.summary())
    click.echo(f"report: {report.output_dir}/{REPORT_FILE}")


if __name__ == "__main__":
    run_command(main)
