"""Write a synthetic LLaVA conversation dataset (coloured shapes + questions) for demos and tests.

    python scripts/data/make_synthetic_dataset.py --output-dir D [--num-samples N] [--lang en|ja]

Then: python scripts/data/build_energon_dataset.py D/llava.json --image-root D --output-dir SHARDS

With --task preference: D/preference.json of chosen/rejected pairs (build it with --task preference).
"""

from megatron_ext.commands.data import synthetic
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(synthetic)
