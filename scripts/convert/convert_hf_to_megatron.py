"""Convert a Hugging Face LLaVA checkpoint into a Megatron dist checkpoint split TP x PP ways.

    python scripts/convert/convert_hf_to_megatron.py --tp N --pp M --hf-dir D --megatron-dir O [--sif-path S] [--force]

O receives release/ (the dist checkpoint and the metadata that rebuilds the model), tokenizer/ (the
HF tokenizer, processor and chat template) and hf_extra.safetensors (HF tensors LLaVA never uses,
restored by convert_megatron_to_hf.py). Runs on CPU with N*M worker processes.
"""

from megatron_ext.commands.convert import hf_to_megatron
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(hf_to_megatron)
