"""transformers imports torchao whenever it is installed (the fp8 extra); torchao's notes about its
environment and torch's deprecation note about it are not printed by a process of ours
(compat/torchao_notes); torchao's errors and torch's other notes are."""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")


def test_a_process_that_loads_torchao_through_transformers_prints_nothing_of_it():
    # torchao.kernel.intmm notes, without Triton, that some of its kernels will not work (lmms-eval's path).
    code = "import megatron_ext, torch, transformers.quantizers, torchao.kernel.intmm; print('loaded')"
    result = run([sys.executable, "-c", code], timeout=100, fresh=True)
    assert result.stdout.split() == ["loaded"] and result.stderr == "", result.stderr


def test_torchaos_errors_and_torchs_other_notes_still_print():
    code = ("import logging, megatron_ext; logging.basicConfig(); "
            "logging.getLogger('torchao.float8').error('an error of torchao'); "
            "logging.getLogger('torch.utils._pytree').warning('another note')")
    stderr = run([sys.executable, "-c", code], timeout=100, fresh=True).stderr
    assert "an error of torchao" in stderr and "another note" in stderr, stderr
