"""A user's own small dataset: built with the defaults, it trains and evaluates without extra flags."""

from __future__ import annotations

import pytest

from megatron_ext.data.build import build_energon_dataset
from megatron_ext.data.synthetic import SyntheticSpec, make_synthetic_dataset
from tests.helpers import run_script
from tests.train.conftest import metrics, trainer_args


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """37 synthetic samples built with the defaults: train 33, val 4."""
    root = tmp_path_factory.mktemp("small")
    source = make_synthetic_dataset(root / "src", SyntheticSpec(num_samples=37, seed=5))
    return build_energon_dataset(source, root / "energon", num_workers=0).output_dir


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_thirty_seven_samples_built_with_the_defaults_train_one_epoch_without_a_flag_more(tmp_path, megatron_clip,
                                                                                            small_data):
    save = tmp_path / "run"
    run_script("train/pretrain_llava.py", *trainer_args(megatron_clip, small_data, save, train_iters=None), timeout=300)
    # One epoch of the 33 training samples at global batch 4.
    assert sorted(metrics(save)) == list(range(1, 10))
