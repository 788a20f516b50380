"""Convert a Megatron checkpoint (converted or trained, any TP/PP) back to a Hugging Face LLaVA directory.

    python scripts/convert/convert_megatron_to_hf.py [--tp N --pp M] --megatron-dir D --hf-dir O [--tokenizer-dir T]

D is a checkpoint root (its latest snapshot is converted) or one snapshot directory (iter_0000100/).
The TP/PP layout is read from the checkpoint; --tp/--pp, when given, must match it. O receives
sharded safetensors, config.json, generation_config.json, tokenizer and processor; T defaults to
the tokenizer stored in the checkpoint.
"""

from megatron_ext.commands.convert import megatron_to_hf
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(megatron_to_hf)
