"""The tiny end-to-end demo on CPU: build, convert, prepare data, train (stage 1 + 2, TP2), convert
back, answer a question about an image, evaluate on the val split, then DPO on preference pairs.

    python scripts/demo/run_demo.py [--output-dir demo_output]
"""

from megatron_ext.commands.demo import demo
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(demo)
