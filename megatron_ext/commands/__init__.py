"""The command-line programs, installed as console scripts (pyproject.toml) and run by the thin
files under scripts/ (the paths the original README uses):

    megatron-ext-train      scripts/train/run.py                     (the launcher)
    megatron-ext-convert    build-llava | hf-to-megatron | megatron-to-hf | compare
    megatron-ext-data       build | synthetic
    megatron-ext-generate, megatron-ext-chat, megatron-ext-evaluate
    megatron-ext-demo       the tiny end-to-end demo
    megatron-ext-parity     scripts/train/check_parity.py            (our trainer against transformers')

Each group also runs as `python -m megatron_ext.commands.<module> <command>`.
"""
