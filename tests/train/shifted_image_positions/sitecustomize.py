"""Test double, imported by every Python process that has this directory on PYTHONPATH: in torchrun's
workers (the trainer's ranks), the task encoder's mRoPE positions of image tokens are one more than
transformers' (`get_rope_index`), the defect the Qwen2.5-VL parity check must catch."""

import os

if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers only, not for the launcher
    from megatron_ext.data import native_resolution_encoder
    from megatron_ext.data.native_resolution import IMAGE

    _positions = native_resolution_encoder.mrope_positions

    def _shifted(types, *args, **kwargs):
        positions = _positions(types, *args, **kwargs)
        positions[:, types == IMAGE] += 1
        return positions

    native_resolution_encoder.mrope_positions = _shifted
