"""Answer prompts about images from a Megatron or Hugging Face LLaVA checkpoint.

    python scripts/eval/generate.py --megatron-dir D --image cat.jpg --prompt "What is this?"
    python scripts/eval/generate.py --hf-dir D --input-jsonl requests.jsonl --output-jsonl answers.jsonl
    torchrun --nproc-per-node 2 scripts/eval/generate.py --megatron-dir D --tp 2 --image F --prompt P

Greedy by default (--temperature 0); stops at the end-of-turn token or after --max-new-tokens.
A single prompt is streamed to the terminal; --input-jsonl lines are {"image", "prompt", "id"}.
"""

import click

from megatron_ext.errors import run_command
from megatron_ext.eval.cli_options import checkpoint_options, make_sampling, sampling_options
from megatron_ext.progress import quiet_option


@click.command()
@quiet_option
@checkpoint_options
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="Image the prompt is about; repeat for several (placed by <image> in the prompt, else before it).")
@click.option("--prompt", help="The question or instruction.")
@click.option("--input-jsonl", type=click.Path(dir_okay=False), help="Batch mode: one {\"image\", \"prompt\"} per line.")
@click.option("--output-jsonl", type=click.Path(dir_okay=False), help="Write the answers here (default: stdout).")
@sampling_options(default_max_new_tokens=128)
def main(megatron_dir, hf_dir, tp, pp, chat_template, dtype, image_aspect, images, prompt, input_jsonl, output_jsonl, max_new_tokens,
         temperature, top_p, seed):
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.batch import generate_answers
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.logs import setup_logging

    setup_logging()
    options = make_sampling(max_new_tokens, temperature, top_p, seed)
    source = open_checkpoint(megatron_dir, hf_dir, chat_template, dtype, image_aspect)
    try:
        generate_answers(source, options, tp=tp, pp=pp, images=images, prompt=prompt, input_jsonl=input_jsonl,
                         output_jsonl=output_jsonl)
    finally:
        shutdown()


if __name__ == "__main__":
    run_command(main)
