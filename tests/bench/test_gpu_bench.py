"""bench/gpu_bench.py runs end to end on its tiny preset (the code the GPU figures come from)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _bench(*args) -> dict:
    proc = run_python("bench/gpu_bench.py", "--preset", "tiny", "--iters", "2", "--warmup", "1", *args, timeout=240)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [(), ("--attention-backend", "local", "--no-packing", "--recompute-granularity",
                                       "selective", "--peak-tflops", "0.5")], ids=["sdpa-packed", "local-unpacked"])
def test_prints_throughput_as_a_final_json_line(args):
    result = _bench(*args)
    for key in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib"):
        assert result[key] > 0, key
    peak = float(args[-1]) if args else 989.0
    assert result["mfu"] == pytest.approx(result["tflops_per_gpu"] / peak)
    assert result["attention_backend"] == ("local" if args else "sdpa")
    assert result["packing"] is not bool(args)
    # Packs hold several samples: fewer micro batches than the 16 samples of a step.
    assert (result["micro_batches_per_step"] < 16) is not bool(args)


@pytest.mark.timeout(120)
def test_gpu_check_says_in_one_line_that_it_needs_a_gpu():
    from tests.support.helpers import REPO_ROOT, child_env, run

    proc = run(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh")], timeout=100, check=False,
               env=child_env(PYTHON=sys.executable))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: torch sees no CUDA GPU here; run it on a GPU node "
        "(or: singularity exec --nv IMAGE bash scripts/gpu_check.sh)"]
