"""Test double, imported by every Python process that has this directory on PYTHONPATH: in the rank
FAIL_IN_RANK of a trainer, building the trainer fails (FAILURE=user: a UserError, as a corrupt data
shard only that rank reads would give; FAILURE=bug: a RuntimeError) while the other ranks wait for it."""

import os

if os.environ.get("FAIL_IN_RANK") and os.environ.get("RANK") == os.environ["FAIL_IN_RANK"]:
    from megatron_ext.errors import UserError
    from megatron_ext.train import trainer

    def _fail(self, plan):
        if os.environ["FAILURE"] == "user":
            raise UserError("data shard /data/shard_7.tar is corrupt (unexpected end of archive); rebuild it")
        raise RuntimeError("injected failure while building the trainer")

    trainer.Trainer.__init__ = _fail
