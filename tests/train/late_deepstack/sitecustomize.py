"""Test double, imported by every Python process that has this directory on PYTHONPATH: in torchrun's
workers (the trainer's ranks), Qwen3-VL's DeepStack feature i is added after decoder layer i + 1
instead of layer i, the defect the Qwen3-VL parity check must catch."""

import os

if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers only, not for the launcher
    from megatron_ext.model.mrope_vlm import MRopeVisionLanguageModel

    _hook = MRopeVisionLanguageModel._deepstack_hook

    def _one_layer_late(self, index):
        return _hook(self, index - 1) if index else (lambda layer, args, output: None)

    MRopeVisionLanguageModel._deepstack_hook = _one_layer_late
