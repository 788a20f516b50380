"""Test double, imported by every Python process that has this directory on PYTHONPATH: in torchrun's
workers (the trainer's ranks), packed native-resolution rows go without their THD boundaries, so a
pack's samples attend to the samples before them, the defect the Qwen2.5-VL parity check must catch."""

import os

if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers only, not for the launcher
    from megatron_ext.model import mrope_inputs

    _inputs = mrope_inputs.MRopeInputs.__call__

    def _without_boundaries(self, batch):
        kwargs = _inputs(self, batch)
        kwargs.pop("packed_seq_params", None)
        return kwargs

    mrope_inputs.MRopeInputs.__call__ = _without_boundaries
