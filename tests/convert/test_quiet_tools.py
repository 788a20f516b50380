"""The convert commands and generation, run on a CPU with stderr not a terminal, print our own log
lines only: no third-party warnings (deprecations, Apex / Transformer Engine fallbacks, advice for
CUDA) and no progress bars."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from tests.support.helpers import REPO_ROOT, started

BAR_MARKS = ("\r", "█", "it/s]")  # tqdm's redraws, blocks and rate


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_convert_both_ways_compare_and_generate_print_no_warnings_and_no_bars(llava_clip, megatron_clip, tmp_path):
    from megatron_ext.convert.compare import synthetic_image

    image = tmp_path / "image.png"
    synthetic_image(seed=2).save(image)
    commands = {
        "hf-to-megatron": ["convert/convert_hf_to_megatron.py", "--hf-dir", llava_clip, "--megatron-dir",
                           tmp_path / "megatron"],
        "megatron-to-hf": ["convert/convert_megatron_to_hf.py", "--megatron-dir", megatron_clip, "--hf-dir",
                           tmp_path / "hf"],
        "compare": ["convert/compare_hf_megatron.py", "--hf-dir", llava_clip, "--megatron-dir", megatron_clip,
                    "--tp", 2, "--image", image, "--prompt", "What is this?"],
        "generate": ["eval/generate.py", "--megatron-dir", megatron_clip, "--image", image, "--prompt", "What is this?",
                     "--max-new-tokens", 2],
    }
    with contextlib.ExitStack() as stack:  # side by side: each is mostly imports
        procs = {name: stack.enter_context(started([sys.executable, str(REPO_ROOT / "scripts" / args[0]),
                                                    *map(str, args[1:])], stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True))
                 for name, args in commands.items()}
        results = {name: (proc.communicate(timeout=280)[1], proc.returncode) for name, proc in procs.items()}
    for name, (stderr, status) in results.items():
        assert status == 0, (name, stderr)
        assert "Warning" not in stderr and "CUDA_DEVICE_MAX_CONNECTIONS" not in stderr, (name, stderr)
        assert not any(mark in stderr for mark in BAR_MARKS), (name, stderr)
        assert " INFO megatron_ext." in stderr, (name, stderr)  # our own lines stay
