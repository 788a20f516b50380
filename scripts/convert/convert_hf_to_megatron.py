"""Convert a Hugging Face LLaVA checkpoint into a Megatron dist checkpoint split TP x PP ways.

    python scripts/convert/convert_hf_to_megatron.py --tp N --pp M --hf-dir D --megatron-dir O [--sif-path S] [--force]

O receives release/ (the dist checkpoint and the metadata that rebuilds the model), tokenizer/ (the
HF tokenizer, processor and chat template) and hf_extra.safetensors (HF tensors LLaVA never uses,
restored by convert_megatron_to_hf.py). Runs on CPU with N*M worker processes.
"""

import click

from megatron_ext.container import rerun_in_container
from megatron_ext.errors import run_command
from megatron_ext.progress import quiet_option


@click.command()
@quiet_option
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size of the checkpoint.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size of the checkpoint.")
@click.option("--hf-dir", required=True, type=click.Path(file_okay=False), help="HF LLaVA checkpoint to convert.")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Where to write the Megatron checkpoint.")
@click.option("--force", is_flag=True, help="Replace a non-empty --megatron-dir.")
@click.option("--sif-path", type=click.Path(dir_okay=False), help="Run inside this Singularity/Apptainer image.")
def main(tp, pp, hf_dir, megatron_dir, force, sif_path):
    if sif_path:
        rerun_in_container(sif_path, binds=[hf_dir, megatron_dir])
    from megatron_ext.convert.cpu_ranks import start_fork_server

    # The workers' fork server imports torch and megatron-core while this process imports and checks.
    start_fork_server("megatron_ext.convert.to_megatron")
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.logs import setup_logging

    setup_logging()
    path = convert(hf_dir, megatron_dir, tp, pp, force)
    click.echo(f"Megatron checkpoint (TP{tp} x PP{pp}) written to {path}")


if __name__ == "__main__":
    run_command(main)
