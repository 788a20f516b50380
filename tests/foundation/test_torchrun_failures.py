"""Under torchrun alone (multi-rank generation and evaluation are started so), a rank that failed
says why; a peer's lost connection to it is not printed: that rank waits, and torchrun stops it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.support.helpers import child_env, run_torchrun

DOUBLE = Path(__file__).with_name("generation_failure")  # its sitecustomize makes rank FAIL_IN_RANK's load fail


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_generation_at_tp2_shows_the_failing_rank_0s_error_not_rank_1s_lost_connection(megatron_clip, tmp_path):
    from megatron_ext.convert.compare import synthetic_image

    image = tmp_path / "image.png"
    synthetic_image(seed=1).save(image)
    path = os.pathsep.join(p for p in (str(DOUBLE), os.environ.get("PYTHONPATH")) if p)
    proc = run_torchrun(2, "scripts/eval/generate.py", "--megatron-dir", megatron_clip, "--tp", 2, "--image", image,
                        "--prompt", "What is this?", "--max-new-tokens", 2,
                        env=child_env(PYTHONPATH=path, FAIL_IN_RANK="0"), check=False, timeout=280)
    assert proc.returncode != 0
    stderr = re.sub(r"^\[rank\d\]: ", "", proc.stderr, flags=re.MULTILINE)  # torch's excepthook marks each line
    assert stderr.count("in _fail\n    raise AssertionError\nAssertionError\n") == 1, stderr
    assert "Connection" not in stderr, stderr
