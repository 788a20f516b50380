"""Sample counts of prepared datasets and metadataset blends, read without torch."""

from __future__ import annotations

import shutil
import sys

import pytest
import yaml

from megatron_ext.data.prepared import dir_split_counts, split_counts
from megatron_ext.errors import UserError
from tests.support.helpers import run


@pytest.mark.multiprocess
def test_prepared_directory_counts_per_split(prepared):
    assert dir_split_counts(prepared) == {"train": 12, "val": 12, "test": 0}
    counts = split_counts(prepared)
    assert counts["train"].samples == 12 and counts["train"].members == [(str(prepared), 1.0, 12)]


@pytest.mark.multiprocess
def test_excluded_shards_and_samples_are_not_counted(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    split_file = copy / ".nv-meta" / "split.yaml"
    config = yaml.safe_load(split_file.read_text())
    train_shard = sorted(p.name for p in copy.glob("*.tar"))[0]
    val_shard = sorted(p.name for p in copy.glob("*.tar"))[-1]
    config["exclude"] = [train_shard, f"{val_shard}/000000023"]
    split_file.write_text(yaml.safe_dump(config))
    assert dir_split_counts(copy) == {"train": 8, "val": 11, "test": 0}


@pytest.mark.multiprocess
def test_metadataset_blends_count_their_members(prepared, tmp_path):
    (tmp_path / "blend.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {
            "train": {"blend": [{"weight": 3, "path": str(prepared)}, {"weight": 1, "path": str(prepared), "split_part": "val"}]},
            "val": {"path": str(prepared)},
        },
    }))
    (tmp_path / "epochs.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"blend_epochized": [{"repetitions": 2, "path": "blend.yaml"}, {"repetitions": 1, "path": str(prepared)}]}},
    }))
    blend = split_counts(tmp_path / "blend.yaml")
    assert blend["train"].samples == 24
    assert [(w, n) for _, w, n in blend["train"].members] == [(3.0, 12), (1.0, 12)]
    assert blend["val"].samples == 12 and blend["test"].samples == 0
    # blend.yaml's train split (24 samples) twice, plus the dataset's train split once.
    assert split_counts(tmp_path / "epochs.yaml")["train"].samples == 2 * 24 + 12
    # Drawn by weight, so read endlessly: the weighted blend, and the epochized one holding it; not a
    # directory, a plain path or an epochized blend of directories, which energon reads in passes.
    (tmp_path / "passes.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"blend_epochized": [{"repetitions": 2, "path": str(prepared)}]},
                   "val": {"path": "blend.yaml"}},
    }))
    assert blend["train"].by_weight and split_counts(tmp_path / "epochs.yaml")["train"].by_weight
    assert not blend["val"].by_weight and not split_counts(prepared)["train"].by_weight
    assert not split_counts(tmp_path / "passes.yaml")["train"].by_weight
    assert not split_counts(tmp_path / "passes.yaml")["val"].by_weight  # blend.yaml's val split is a plain path


def test_not_a_prepared_dataset_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="is not a prepared energon dataset"):
        split_counts(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        split_counts(tmp_path / "missing")
    (tmp_path / "bad.yaml").write_text("just: text\n")
    with pytest.raises(UserError, match="is not an energon metadataset"):
        split_counts(tmp_path / "bad.yaml")
    (tmp_path / "join.yaml").write_text(yaml.safe_dump({"splits": {"train": {"join": []}}}))
    with pytest.raises(UserError, match="join"):
        split_counts(tmp_path / "join.yaml")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_module_imports_no_torch():
    code = "import sys, megatron_ext.data.prepared; sys.exit('torch' in sys.modules or 'megatron.energon' in sys.modules)"
    assert run([sys.executable, "-c", code], timeout=60, check=False).returncode == 0


@pytest.mark.multiprocess
def test_subsets_count_what_energon_takes(prepared, tmp_path):
    """`subset` ranges (fractions nest, sample indices on a dataset) count the samples energon loads."""
    from megatron.energon import WorkerConfig, get_val_dataset

    (tmp_path / "inner.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"path": str(prepared), "subset": {"range": ["0%", "50%"]}}},
    }))
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"blend": [
            {"weight": 2, "path": "inner.yaml", "subset": {"range": ["25%", "75%"]}},
            {"weight": 1, "path": str(prepared), "subset": {"range": [2, 9]}},
            {"weight": 1, "path": str(prepared), "split_part": "val", "subset": {"range": ["10%", "100%"]}},
        ]}},
    }))
    counts = split_counts(tmp_path / "mix.yaml")["train"]
    # 12 train samples: 50% of the middle half = 3; indices 2..8 = 7; 12 val samples from 10% to the end = 11.
    assert [n for _, _, n in counts.members] == [3, 7, 11] and counts.samples == 21
    for path, expected in ((tmp_path / "inner.yaml", 6), (tmp_path / "mix.yaml", 21)):
        dataset = get_val_dataset(str(path), split_part="train", batch_size=1,
                                  worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        assert len(dataset) == expected == split_counts(path)["train"].samples
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"path": "inner.yaml", "subset": {"range": [0, 5]}}},
    }))
    with pytest.raises(UserError, match="subset of sample indices applies to one dataset directory"):
        split_counts(tmp_path / "bad.yaml")


@pytest.mark.multiprocess
def test_the_example_blend_counts_once_its_paths_are_set(prepared, tmp_path):
    from tests.support.helpers import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / "configs/blends/llava15_mix_docs_text.yaml").read_text())
    for member in config["splits"]["train"]["blend"] + [config["splits"]["val"]]:
        member["path"] = str(prepared)
    (tmp_path / "blend.yaml").write_text(yaml.safe_dump(config))
    counts = split_counts(tmp_path / "blend.yaml")
    assert [n for _, _, n in counts["train"].members] == [12, 3, 1] and counts["val"].samples == 12


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llava_next_stage2", "onevision_single_image", "onevision_image_multi_video"])
def test_the_tiled_recipes_blends_count_once_their_paths_are_set(prepared, tmp_path, name):
    from tests.support.helpers import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / f"configs/blends/{name}.yaml").read_text())
    blend = config["splits"]["train"]["blend"]
    for member in blend + [config["splits"]["val"]]:
        member["path"] = str(prepared)
    (tmp_path / "blend.yaml").write_text(yaml.safe_dump(config))
    counts = split_counts(tmp_path / "blend.yaml")
    assert [n for _, _, n in counts["train"].members] == [12] * len(blend) and counts["val"].samples == 12
