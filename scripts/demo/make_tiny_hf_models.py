"""Write tiny random Hugging Face models (text + CLIP + SigLIP towers) for tests and the CPU demo.

    python scripts/demo/make_tiny_hf_models.py --save-dir DIR [--text-arch qwen2] [--tie-word-embeddings]

DIR/text is a Llama-architecture causal LM with grouped-query attention and a locally trained
tokenizer with a chat template; DIR/vision-clip and DIR/vision-siglip are vision towers with
their image processors. Nothing is downloaded.
"""

from megatron_ext.commands.demo import tiny_models
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(tiny_models)
