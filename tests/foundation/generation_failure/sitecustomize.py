"""Test double, imported by every Python process that has this directory on PYTHONPATH: in the
torchrun rank FAIL_IN_RANK of a generation, loading the checkpoint fails with a bare AssertionError,
while the other ranks wait for it in the load's collectives."""

import os

if os.environ.get("FAIL_IN_RANK") and os.environ.get("RANK") == os.environ["FAIL_IN_RANK"]:
    from megatron_ext.lora import checkpoint

    def _fail(model, snapshot):
        raise AssertionError

    checkpoint.load_for_inference = _fail
