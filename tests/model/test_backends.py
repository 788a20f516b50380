"""The attention backends and batch layouts compute the same per-token losses through megatron-core's
LLaVAModel (fp32, CPU, a GQA model; samples with one image, two, or none): sdpa equals megatron's reference kernel, packed
samples equal the same samples alone, aligned (padded) batches equal unpadded ones, at TP2 (which
splits every layer); and TP2's losses equal TP1's, computed in the same launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import run_ranks

WORKER = str(Path(__file__).with_name("backend_worker.py"))
LAYOUTS = ("unpacked", "unpacked-rows", "packed", "packed-rows")


# Compared at TP1 and TP2: both backends, THD and dense-mask packing, padded rows and alignment.
TP1_KEYS = ("sdpa/packed", "sdpa/unpacked-rows", "local/packed-rows", "sdpa/aligned packed")


@pytest.fixture(scope="module")
def losses(tmp_path_factory, megatron_clip) -> dict:
    """The worker's losses at TP2, and under "tp1" those of TP1_KEYS at TP1."""
    path = tmp_path_factory.mktemp("backends") / "losses.json"
    run_ranks(2, WORKER, megatron_clip, path, "local,sdpa", ",".join(TP1_KEYS), timeout=300)
    out = json.loads(path.read_text())
    assert out["tp"] == 2 and sorted(out["tp1"]) == sorted(TP1_KEYS)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and all(len(a[k]) == len(b[k]) > 0 for k in a)
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))


def _mean(losses: dict) -> float:
    values = [x for v in losses.values() for x in v]
    return sum(values) / len(values)


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.mark.parametrize("layout", LAYOUTS + tuple(f"aligned {name}" for name in LAYOUTS))
def test_sdpa_equals_the_reference_kernel(losses, layout):
    assert _max_diff(losses[f"sdpa/{layout}"], losses[f"local/{layout}"]) <= 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_packed_samples_equal_the_same_samples_alone(losses, backend):
    packs = losses[f"{backend}/packs"]
    assert max(len(pack) for pack in packs) >= 3
    # The text-only sample (5) and the two-image one (6) share packs with one-image samples.
    assert all(len(next(p for p in packs if key in p)) > 1 for key in ("5", "6"))
    unpacked = losses[f"{backend}/unpacked"]
    for layout in ("unpacked-rows", "packed", "packed-rows"):
        assert _max_diff(losses[f"{backend}/{layout}"], unpacked) <= 1e-5, layout
    # Not kept apart (no THD boundaries, no mask), packed samples see each other: the check has teeth.
    assert _max_diff(losses[f"{backend}/packed, samples not kept apart"], unpacked) > 1e-2


@pytest.mark.parametrize("backend", ["sdpa", "local"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_aligned_batches_give_the_loss_of_unpadded_ones(losses, backend, layout):
    plain, aligned = losses[f"{backend}/{layout}"], losses[f"{backend}/aligned {layout}"]
    assert _max_diff(aligned, plain) <= 1e-5
    assert _mean(aligned) == pytest.approx(_mean(plain), rel=1e-6)


def test_tensor_parallel_ranks_give_the_losses_of_one(losses):
    for name in TP1_KEYS:
        assert _max_diff(losses[name], losses["tp1"][name]) <= 1e-5, name
