"""Write tiny random Hugging Face models (text + CLIP + SigLIP towers) for tests and the CPU demo.

    python scripts/demo/make_tiny_hf_models.py --save-dir DIR [--text-arch qwen2] [--tie-word-embeddings]

DIR/text is a Llama-architecture causal LM with grouped-query attention and a locally trained
tokenizer with a chat template; DIR/vision-clip and DIR/vision-siglip are vision towers with
their image processors. Nothing is downloaded.
"""

from pathlib import Path

import click

from megatron_ext.errors import run_command
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.hf.tiny_models import TinyTextSpec, make_all
from megatron_ext.logs import setup_logging


@click.command()
@click.option("--save-dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--text-arch", type=click.Choice(["llama", "qwen2"]), default="llama", show_default=True,
              help="qwen2 adds bias to the q/k/v projections.")
@click.option("--tie-word-embeddings", is_flag=True, help="Share the input embedding with the LM head.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty --save-dir.")
def main(save_dir, text_arch, tie_word_embeddings, seed, force):
    setup_logging()
    save_dir = check_output_dir(save_dir, force, "--save-dir")
    spec = TinyTextSpec(arch=text_arch, tie_word_embeddings=tie_word_embeddings)
    with atomic_output_dir(save_dir) as tmp:
        made = make_all(Path(tmp), spec, seed)
    for name in made:
        click.echo(f"{name}: {save_dir / name}")


if __name__ == "__main__":
    run_command(main)
