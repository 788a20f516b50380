"""Fixtures for the data tests: a synthetic LLaVA dataset, built once into prepared shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.data.build import build_energon_dataset
from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset


@pytest.fixture(scope="session")
def synthetic_json(tmp_path_factory) -> Path:
    """24 samples, about half of them multi-turn (3 exchanges), images 48-96 px."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("synthetic") / "src", SyntheticSpec(num_samples=24, multi_turn_fraction=0.5, seed=1))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, synthetic_json) -> Path:
    """The synthetic dataset as prepared shards: 6 shards of 4, train 12 / val 12."""
    out = tmp_path_factory.mktemp("prepared") / "energon"
    build_energon_dataset(synthetic_json, out, split_ratio="1,1,0", samples_per_shard=4, num_workers=0)
    return out
