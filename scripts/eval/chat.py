"""Chat about an image in the terminal with a Megatron or Hugging Face LLaVA checkpoint.

    python scripts/eval/chat.py --megatron-dir D --image cat.jpg
    torchrun --nproc-per-node 2 scripts/eval/chat.py --megatron-dir D --tp 2 --image cat.jpg

Type a message and press Enter; /image PATH switches to another image (new conversation),
/reset forgets the conversation, /exit quits.
"""

import click

from megatron_ext.errors import run_command
from megatron_ext.eval.cli_options import checkpoint_options, make_sampling, sampling_options


@click.command()
@checkpoint_options
@click.option("--image", type=click.Path(dir_okay=False), help="Image to talk about (or /image PATH later).")
@sampling_options(default_max_new_tokens=256)
def main(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, image, max_new_tokens, temperature, top_p, seed):
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.chat import run_chat
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.logs import setup_logging

    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = open_checkpoint(megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        run_chat(source, options, tp=tp, pp=pp, image=image)
    finally:
        shutdown()


if __name__ == "__main__":
    run_command(main)
