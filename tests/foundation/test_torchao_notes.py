"""transformers imports torchao whenever it is installed (the fp8 extra); torchao's import notes (its
C++ extensions it cannot load for this torch) and torch's deprecation note about it are dropped in a
process of ours (compat/torchao_notes), and nothing else of those loggers is."""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")


def test_a_process_that_loads_transformers_quantizers_prints_nothing_of_torchaos_import():
    code = "import megatron_ext, torch, transformers.quantizers; print('loaded')"
    result = run([sys.executable, "-c", code], timeout=100, fresh=True)
    assert result.stdout.split() == ["loaded"] and result.stderr == "", result.stderr


def test_other_records_of_those_loggers_still_print():
    code = ("import logging, megatron_ext; logging.basicConfig(); "
            "logging.getLogger('torchao').warning('a note of torchao\\'s own'); "
            "logging.getLogger('torch.utils._pytree').warning('another note')")
    stderr = run([sys.executable, "-c", code], timeout=100, fresh=True).stderr
    assert "a note of torchao's own" in stderr and "another note" in stderr, stderr
