"""Convert a Megatron checkpoint (converted or trained, any TP/PP) back to a Hugging Face LLaVA directory.

    python scripts/convert/convert_megatron_to_hf.py [--tp N --pp M] --megatron-dir D --hf-dir O [--tokenizer-dir T]

D is a checkpoint root (its latest snapshot is converted) or one snapshot directory (iter_0000100/).
The TP/PP layout is read from the checkpoint; --tp/--pp, when given, must match it. O receives
sharded safetensors, config.json, generation_config.json, tokenizer and processor; T defaults to
the tokenizer stored in the checkpoint.
"""

import click

from megatron_ext.container import rerun_in_container
from megatron_ext.errors import run_command
from megatron_ext.progress import quiet_option


@click.command()
@quiet_option
@click.option("--tp", type=int, help="Expected tensor-parallel size of the checkpoint (checked, not needed).")
@click.option("--pp", type=int, help="Expected pipeline-parallel size of the checkpoint (checked, not needed).")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Megatron checkpoint root or snapshot.")
@click.option("--hf-dir", required=True, type=click.Path(file_okay=False), help="Where to write the HF checkpoint.")
@click.option("--tokenizer-dir", type=click.Path(file_okay=False),
              help="Tokenizer/processor to ship with the model. Default: the checkpoint's tokenizer/.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file.")
@click.option("--force", is_flag=True, help="Replace a non-empty --hf-dir.")
@click.option("--sif-path", type=click.Path(dir_okay=False), help="Run inside this Singularity/Apptainer image.")
def main(tp, pp, megatron_dir, hf_dir, tokenizer_dir, max_shard_size, force, sif_path):
    if sif_path:
        rerun_in_container(sif_path, binds=[megatron_dir, hf_dir, tokenizer_dir])
    from megatron_ext.convert.to_hf import convert
    from megatron_ext.logs import setup_logging

    setup_logging()
    path = convert(megatron_dir, hf_dir, tokenizer_dir, tp, pp, force, max_shard_size)
    click.echo(f"HF checkpoint written to {path}")


if __name__ == "__main__":
    run_command(main)
