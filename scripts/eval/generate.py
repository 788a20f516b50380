"""Answer prompts about images (or videos: LLaVA-OneVision) from a Megatron or Hugging Face LLaVA checkpoint.

    python scripts/eval/generate.py --megatron-dir D --image cat.jpg --prompt "What is this?"
    python scripts/eval/generate.py --hf-dir D --input-jsonl requests.jsonl --output-jsonl answers.jsonl
    torchrun --nproc-per-node 2 scripts/eval/generate.py --megatron-dir D --tp 2 --image F --prompt P

Greedy by default (--temperature 0); stops at the end-of-turn token or after --max-new-tokens.
A single prompt is streamed to the terminal; --input-jsonl lines are {"image", "video", "prompt", "id"}.
"""

from megatron_ext.commands.eval import generate
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(generate)
