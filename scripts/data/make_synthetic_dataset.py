"""Write a synthetic LLaVA conversation dataset (coloured shapes + questions) for demos and tests.

    python scripts/data/make_synthetic_dataset.py --output-dir D [--num-samples N] [--lang en|ja]

Then: python scripts/data/build_energon_dataset.py D/llava.json --image-root D --output-dir SHARDS
"""

import click

from megatron_ext.data.synthetic import SyntheticSpec, make_synthetic_dataset
from megatron_ext.errors import run_command
from megatron_ext.fsutil import check_output_dir


@click.command()
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="Where to write llava.json and images/.")
@click.option("--num-samples", type=click.IntRange(min=1), default=SyntheticSpec.num_samples, show_default=True)
@click.option("--multi-turn-fraction", type=click.FloatRange(0, 1), default=SyntheticSpec.multi_turn_fraction, show_default=True,
              help="Fraction of samples with three question/answer turns.")
@click.option("--min-size", type=click.IntRange(min=8), default=SyntheticSpec.min_size, show_default=True, help="Smallest image side.")
@click.option("--max-size", type=click.IntRange(min=8), default=SyntheticSpec.max_size, show_default=True, help="Largest image side.")
@click.option("--lang", type=click.Choice(["en", "ja"]), default="en", show_default=True, help="Language of questions and answers.")
@click.option("--image-format", type=click.Choice(["jpg", "png"]), default="jpg", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty --output-dir.")
def main(output_dir, num_samples, multi_turn_fraction, min_size, max_size, lang, image_format, seed, force):
    check_output_dir(output_dir, force, "--output-dir")
    spec = SyntheticSpec(num_samples=num_samples, multi_turn_fraction=multi_turn_fraction, min_size=min(min_size, max_size),
                         max_size=max(min_size, max_size), lang=lang, image_format=image_format, seed=seed)
    path = make_synthetic_dataset(output_dir, spec)
    click.echo(f"wrote {num_samples} samples to {path}")


if __name__ == "__main__":
    run_command(main)
