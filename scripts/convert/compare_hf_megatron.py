"""Compare the logits of a HF LLaVA checkpoint and its Megatron conversion on the same inputs.

    python scripts/convert/compare_hf_megatron.py --hf-dir D --megatron-dir O [--tp N --pp M] [--image F --prompt P]

Both models run in float32 on CPU (the Megatron one on N*M processes, default: the layout it was
saved with) on the HF processor's output for a prompt about one or more images (--image, repeatable;
default: a fixed noise image).
Prints max |dlogit|, mean |dlogit| and whether the next-token argmax agrees at every position;
exits 1 when --max-diff is given and exceeded or the argmax disagrees.
"""

from megatron_ext.commands.convert import compare
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(compare)
