"""Test double, imported by every Python process that has this directory on PYTHONPATH (the converter,
its fork server and so its ranks): in the converter rank FAIL_IN_RANK, checking the model fails with
a bare AssertionError, as a check deep inside megatron-core would, while the other ranks wait for it
in a collective (to_megatron._gather)."""

import os

if os.environ.get("FAIL_IN_RANK"):
    from megatron_ext.convert import to_megatron

    _check_model = to_megatron.check_model

    def _fail(model, arch, weights):
        if os.environ.get("RANK") == os.environ["FAIL_IN_RANK"]:
            raise AssertionError
        return _check_model(model, arch, weights)

    to_megatron.check_model = _fail
