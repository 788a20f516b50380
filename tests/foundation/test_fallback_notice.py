"""megatron-core warns from four modules, at import, that Transformer Engine and Apex are missing; a
process of ours says it once, in our words (compat/fallback_notice), and on a CPU only with --debug."""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import run

pytestmark = pytest.mark.multiprocess

IMPORTS = ("import megatron.core.optimizer, megatron.core.optimizer.clip_grads, "
           "megatron.core.models.multimodal.llava_spec")
NOTE = "Transformer Engine / Apex not installed here"


def test_megatron_core_fallback_warnings_are_not_printed_before_logging_is_set_up():
    result = run([sys.executable, "-c", f"import megatron_ext; {IMPORTS}"], timeout=120, fresh=True)
    assert "not installed" not in result.stderr, result.stderr


def test_the_fallback_is_said_once_in_our_words_with_debug_on_a_cpu():
    code = (f"import megatron_ext; {IMPORTS}; from megatron_ext.logs import setup_logging; "
            "setup_logging(verbose=True); setup_logging(verbose=True)")
    stderr = run([sys.executable, "-c", code], timeout=120, fresh=True).stderr
    assert stderr.count(NOTE) == 1 and "Apex are not installed" not in stderr, stderr
