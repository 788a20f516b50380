"""megatron_ext: train LLaVA-style vision-language models on megatron-core.

Folders: `hf/` (Hugging Face checkpoints: LLaVA assembly), `demo/` (the demo, its tiny models and synthetic data), `model/` (the
megatron-core LLaVAModel built from an HF config), `convert/` (HF <-> Megatron converters),
`checkpoint/` (checkpoint directory layout and metadata), `data/` (energon datasets and the task
encoder), `train/` (the trainer), `launch/` (torchrun / Singularity / SLURM command building),
`eval/` (generation, chat, evaluation).
"""

from megatron_ext.compat import fallback_notice, quick_exit, releases, torchao_notes

__version__ = "0.1.0"

releases.quiet_import()
quick_exit.install()
fallback_notice.install()
torchao_notes.install()
