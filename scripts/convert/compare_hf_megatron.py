"""Compare the logits of a HF LLaVA checkpoint and its Megatron conversion on the same inputs.

    python scripts/convert/compare_hf_megatron.py --hf-dir D --megatron-dir O [--tp N --pp M] [--image F --prompt P]

Both models run in float32 on CPU (the Megatron one on N*M processes, default: the layout it was
saved with) on the HF processor's output for a prompt about one or more images (--image, repeatable;
default: a fixed noise image).
Prints max |dlogit|, mean |dlogit| and whether the next-token argmax agrees at every position;
exits 1 when --max-diff is given and exceeded or the argmax disagrees.
"""

import sys

import click

from megatron_ext.container import rerun_in_container
from megatron_ext.errors import UserError, run_command


@click.command()
@click.option("--hf-dir", required=True, type=click.Path(file_okay=False), help="HF LLaVA checkpoint.")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Megatron checkpoint root or snapshot.")
@click.option("--tp", type=int, help="Tensor-parallel size to run the Megatron model at (default: as saved).")
@click.option("--pp", type=int, help="Pipeline-parallel size to run the Megatron model at (default: as saved).")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="Image file; repeat for several images (default: a fixed random-noise image).")
@click.option("--prompt", default="Describe this image.", show_default=True, help="User prompt.")
@click.option("--max-diff", type=float, help="Fail (exit 1) when max |dlogit| exceeds this.")
@click.option("--sif-path", type=click.Path(dir_okay=False), help="Run inside this Singularity/Apptainer image.")
def main(hf_dir, megatron_dir, tp, pp, images, prompt, max_diff, sif_path):
    if sif_path:
        rerun_in_container(sif_path, binds=[hf_dir, megatron_dir, *images])
    from megatron_ext.convert.compare import compare
    from megatron_ext.logs import setup_logging

    setup_logging()
    stats = compare(hf_dir, megatron_dir, tp, pp, [_open_image(image) for image in images], prompt)
    for line in stats.lines():
        click.echo(line)
    if not stats.argmax_agree or (max_diff is not None and stats.max_abs > max_diff):
        sys.exit(1)


def _open_image(path):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise UserError(f"--image {path} cannot be read as an image ({exc})") from exc


if __name__ == "__main__":
    run_command(main)
