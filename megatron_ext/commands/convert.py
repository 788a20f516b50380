"""megatron-ext-convert: assemble an HF LLaVA, convert it to Megatron and back, compare the two.

    megatron-ext-convert build-llava --save-dir D --text-model T [--vision-model V] [--vocab-size-padding]
                                     [--arch llava|llava-next|llava-onevision] [--image-grid-pinpoints HxW,...]
    megatron-ext-convert hf-to-megatron --tp N --pp M --hf-dir D --megatron-dir O
    megatron-ext-convert megatron-to-hf --megatron-dir D --hf-dir O
    megatron-ext-convert compare --hf-dir D --megatron-dir O [--tp N --pp M] [--image F --prompt P]

(scripts/convert/build_llava_jp.py, convert_hf_to_megatron.py, convert_megatron_to_hf.py and
compare_hf_megatron.py run the same commands.) With --sif-path each re-runs itself inside a
Singularity/Apptainer image.
"""

import os
import sys

import click

from megatron_ext.errors import run_command
from megatron_ext.families import llava_kinds
from megatron_ext.hf.build_llava import DEFAULT_VISION_MODEL
from megatron_ext.model.backends import STORED_DTYPES
from megatron_ext.progress import quiet_option

_SIF_OPTION = click.option("--sif-path", type=click.Path(dir_okay=False), help="Run inside this Singularity/Apptainer image.")


def _in_container(sif_path: str, binds: list) -> None:
    """Run this very command again inside the image (and exit with its status)."""
    from megatron_ext.container import rerun_in_container

    ctx = click.get_current_context()
    if ctx.parent is None:  # a script under scripts/: the script is the program
        program, args = [os.path.abspath(sys.argv[0])], sys.argv[1:]
    else:  # a command of the group (console script or python -m): the group's module runs it
        program, args = ["-m", __spec__.name, ctx.info_name], sys.argv[2:]
    rerun_in_container(sif_path, program, args, binds)


@click.command("build-llava")
@click.option("--save-dir", required=True, type=click.Path(file_okay=False), help="Where to write the LLaVA checkpoint.")
@click.option("--text-model", required=True, help="Text model: Hub tag or local directory (with its tokenizer).")
@click.option("--vision-model", default=DEFAULT_VISION_MODEL, show_default=True,
              help="Vision encoder (CLIP, SigLIP or InternViT): Hub tag or local directory.")
@click.option("--vocab-size-padding", is_flag=True, help="Pad the embedding and LM head to a multiple of 128 rows.")
@click.option("--dtype", type=click.Choice(["auto", *STORED_DTYPES]), default="auto", show_default=True,
              help="Weights dtype; auto keeps the text model's.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the projector's initial weights.")
@click.option("--arch", type=click.Choice(list(llava_kinds())), default="llava", show_default=True,
              help="LLaVA-1.5 (one tile per image), LLaVA-NeXT or LLaVA-OneVision (anyres tiles; OneVision: video too).")
@click.option("--image-grid-pinpoints", help="Tiled archs: the HEIGHTxWIDTH grids images are resized into, multiples "
              "of the tower's image size (e.g. 672x336,336x672); default: the published models' grids of it.")
@click.option("--anyres-max", type=int, default=9, show_default=True,
              help="llava-onevision: grids beyond about N tiles' features are downsampled (anyres_max_N).")
@click.option("--force", is_flag=True, help="Replace a non-empty --save-dir.")
@_SIF_OPTION
def build_llava(save_dir, text_model, vision_model, vocab_size_padding, dtype, seed, arch, image_grid_pinpoints,
                anyres_max, force, sif_path):
    """Assemble a Hugging Face LLaVA checkpoint from a text model and a vision encoder."""
    if sif_path:
        _in_container(sif_path, [save_dir, text_model, vision_model])
    from megatron_ext.hf.build_llava import build_llava as build
    from megatron_ext.hf.build_llava import parse_pinpoints
    from megatron_ext.logs import setup_logging

    setup_logging()
    pinpoints = parse_pinpoints(image_grid_pinpoints) if image_grid_pinpoints else None
    path = build(save_dir, text_model, vision_model, vocab_size_padding, force, dtype, seed, arch=arch,
                 image_grid_pinpoints=pinpoints, anyres_max=anyres_max)
    click.echo(f"LLaVA checkpoint written to {path}")


@click.command("hf-to-megatron")
@quiet_option
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size of the checkpoint.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size of the checkpoint.")
@click.option("--hf-dir", required=True, type=click.Path(file_okay=False), help="HF LLaVA checkpoint to convert.")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Where to write the Megatron checkpoint.")
@click.option("--force", is_flag=True, help="Replace a non-empty --megatron-dir.")
@_SIF_OPTION
def hf_to_megatron(tp, pp, hf_dir, megatron_dir, force, sif_path):
    """Convert a Hugging Face LLaVA checkpoint into a Megatron dist checkpoint split TP x PP ways."""
    if sif_path:
        _in_container(sif_path, [hf_dir, megatron_dir])
    from megatron_ext.convert.cpu_ranks import start_fork_server

    # The workers' fork server imports torch and megatron-core while this process imports and checks.
    start_fork_server("megatron_ext.convert.to_megatron")
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.logs import setup_logging

    setup_logging()
    path = convert(hf_dir, megatron_dir, tp, pp, force)
    click.echo(f"Megatron checkpoint (TP{tp} x PP{pp}) written to {path}")


@click.command("megatron-to-hf")
@quiet_option
@click.option("--tp", type=int, help="Expected tensor-parallel size of the checkpoint (checked, not needed).")
@click.option("--pp", type=int, help="Expected pipeline-parallel size of the checkpoint (checked, not needed).")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Megatron checkpoint root or snapshot.")
@click.option("--hf-dir", type=click.Path(file_okay=False), help="Where to write the HF checkpoint.")
@click.option("--tokenizer-dir", type=click.Path(file_okay=False),
              help="Tokenizer/processor to ship with the model. Default: the checkpoint's tokenizer/.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file.")
@click.option("--lora-merge", is_flag=True, help="An adapter checkpoint (a --lora-rank run's): write its base with the "
                                                 "adapters merged, a plain HF LLaVA.")
@click.option("--lora-adapter-dir", type=click.Path(file_okay=False),
              help="An adapter checkpoint: write its adapters here as a PEFT LoRA adapter for the HF export of its "
                   "base checkpoint (peft.PeftModel.from_pretrained loads it).")
@click.option("--force", is_flag=True, help="Replace a non-empty --hf-dir / --lora-adapter-dir.")
@_SIF_OPTION
def megatron_to_hf(tp, pp, megatron_dir, hf_dir, tokenizer_dir, max_shard_size, lora_merge, lora_adapter_dir, force,
                   sif_path):
    """Convert a Megatron checkpoint (converted or trained, any TP/PP) back to a Hugging Face LLaVA directory."""
    if sif_path:
        _in_container(sif_path, [megatron_dir, hf_dir, tokenizer_dir, lora_adapter_dir])
    from megatron_ext.convert.to_hf import convert
    from megatron_ext.errors import UserError
    from megatron_ext.logs import setup_logging

    setup_logging()
    if not hf_dir and not lora_adapter_dir:
        raise UserError("give --hf-dir (an HF model) or, for an adapter checkpoint, --lora-adapter-dir (a PEFT adapter)")
    if lora_adapter_dir:
        from megatron_ext.convert.lora_export import write_peft_adapter

        click.echo(f"PEFT adapter written to {write_peft_adapter(megatron_dir, lora_adapter_dir, force)}")
    if hf_dir:
        path = convert(megatron_dir, hf_dir, tokenizer_dir, tp, pp, force, max_shard_size, lora_merge=lora_merge)
        click.echo(f"HF checkpoint written to {path}")


@click.command("compare")
@click.option("--hf-dir", required=True, type=click.Path(file_okay=False), help="HF LLaVA checkpoint.")
@click.option("--megatron-dir", required=True, type=click.Path(file_okay=False), help="Megatron checkpoint root or snapshot.")
@click.option("--tp", type=int, help="Tensor-parallel size to run the Megatron model at (default: as saved).")
@click.option("--pp", type=int, help="Pipeline-parallel size to run the Megatron model at (default: as saved).")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="Image file; repeat for several images (default: a fixed random-noise image).")
@click.option("--prompt", default="Describe this image.", show_default=True, help="User prompt.")
@click.option("--max-diff", type=float, help="Fail (exit 1) when max |dlogit| exceeds this.")
@_SIF_OPTION
def compare(hf_dir, megatron_dir, tp, pp, images, prompt, max_diff, sif_path):
    """Compare the logits of an HF LLaVA checkpoint and its Megatron conversion on the same inputs
    (float32, CPU); exit 1 when --max-diff is exceeded or the next-token argmax disagrees."""
    if sif_path:
        _in_container(sif_path, [hf_dir, megatron_dir, *images])
    from megatron_ext.convert.compare import compare as compare_logits
    from megatron_ext.eval.prompts import load_image
    from megatron_ext.logs import setup_logging

    setup_logging()
    stats = compare_logits(hf_dir, megatron_dir, tp, pp, [load_image(image) for image in images], prompt)
    for line in stats.lines():
        click.echo(line)
    if not stats.argmax_agree or (max_diff is not None and stats.max_abs > max_diff):
        sys.exit(1)


group = click.Group("megatron-ext-convert", help=__doc__.split("\n")[0],
                    commands=[build_llava, hf_to_megatron, megatron_to_hf, compare])


def main() -> None:
    run_command(group)


if __name__ == "__main__":
    main()
