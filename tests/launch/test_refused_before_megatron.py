"""What megatron-core would refuse deep inside the ranks, run.py refuses before anything starts, in
one line naming the flag."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_sequence_parallel_without_tensor_parallel_is_one_line_and_nothing_starts(launcher, inputs, tmp_path):
    """Where Transformer Engine is (in the image: --sif-path), megatron-core's ModelParallelConfig
    would otherwise raise "Cannot use sequence parallelism without tensor parallelism" in every rank."""
    sif = tmp_path / "image.sif"
    sif.write_text("")
    result = launcher.run("--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data),
                          "--sif-path", str(sif), "--", "--sequence-parallel", gpus=1)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr == ("error: --sequence-parallel splits activations over the --tp ranks: it needs --tp 2 "
                             "or more (got --tp 1); drop it or raise --tp\n")
    assert launcher.records() == []
