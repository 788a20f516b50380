"""Assemble a Hugging Face LLaVA checkpoint from a text model and a vision encoder.

    python scripts/convert/build_llava_jp.py --save-dir D --text-model T [--vision-model V] [--vocab-size-padding]
        [--arch llava|llava-next|llava-onevision] [--image-grid-pinpoints HxW,...] [--anyres-max N]

T and V are Hugging Face Hub tags or local directories. Adds the <image> and <pad> tokens when
missing, creates a fresh 2-layer GELU projector (and image_newline for the tiled archs), and writes
model + tokenizer + processor.
"""

from megatron_ext.commands.convert import build_llava
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(build_llava)
