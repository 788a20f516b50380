"""Assemble a Hugging Face LLaVA checkpoint from a text model and a vision encoder.

    python scripts/convert/build_llava_jp.py --save-dir D --text-model T [--vision-model V] [--vocab-size-padding]

T and V are Hugging Face Hub tags or local directories. Adds the <image> and <pad> tokens when
missing, creates a fresh 2-layer GELU projector, and writes model + tokenizer + processor.
"""

import click

from megatron_ext.container import rerun_in_container
from megatron_ext.errors import run_command
from megatron_ext.hf.build_llava import DEFAULT_VISION_MODEL, build_llava
from megatron_ext.logs import setup_logging


@click.command()
@click.option("--save-dir", required=True, type=click.Path(file_okay=False), help="Where to write the LLaVA checkpoint.")
@click.option("--text-model", required=True, help="Text model: Hub tag or local directory (with its tokenizer).")
@click.option("--vision-model", default=DEFAULT_VISION_MODEL, show_default=True,
              help="Vision encoder (CLIP or SigLIP): Hub tag or local directory.")
@click.option("--vocab-size-padding", is_flag=True, help="Pad the embedding and LM head to a multiple of 128 rows.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Weights dtype; auto keeps the text model's.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the projector's initial weights.")
@click.option("--force", is_flag=True, help="Replace a non-empty --save-dir.")
@click.option("--sif-path", type=click.Path(dir_okay=False), help="Run inside this Singularity/Apptainer image.")
def main(save_dir, text_model, vision_model, vocab_size_padding, dtype, seed, force, sif_path):
    if sif_path:
        rerun_in_container(sif_path, binds=[save_dir, text_model, vision_model])
    setup_logging()
    path = build_llava(save_dir, text_model, vision_model, vocab_size_padding, force, dtype, seed)
    click.echo(f"LLaVA checkpoint written to {path}")


if __name__ == "__main__":
    run_command(main)
