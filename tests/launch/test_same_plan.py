"""run.py and the trainer started directly make one plan: the same defaults, the same refusals in the same words."""

from __future__ import annotations

import shlex

import pytest

from megatron_ext.config.run_plan import make_plan
from tests.launch.test_commands import _trainer, split_torchrun
from tests.support.helpers import child_env, run_script
from tests.support.launcher import write_prepared_dataset, write_tokenizer

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


# (run.py arguments, the same given to the trainer, iterations both must train)
LENGTHS = {
    "one epoch by default": ([], [], 125),  # 1000 training samples / global batch 8
    "epochs": (["--", "--epochs", "2.5"], ["--epochs", "2.5"], 313),
    "iterations": (["--", "--train-iters", "7"], ["--train-iters", "7"], 7),
}


@pytest.mark.parametrize("name", list(LENGTHS))
def test_direct_trainer_plans_what_the_launcher_launches(launcher, inputs, name):
    launcher_extra, trainer_extra, iters = LENGTHS[name]
    common = ["--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data), "--stage", "2",
              "--global-batch-size", "8"]
    dry = launcher.run("--dry-run", *common, *launcher_extra)
    assert dry.returncode == 0, dry.stderr
    _, launched = split_torchrun(shlex.split(dry.stdout)[1:])
    direct = make_plan(_trainer.main([*common, *trainer_extra], standalone_mode=False), world_size=1, on_gpu=False,
                       te=False)
    from_launched = make_plan(launched, world_size=1, on_gpu=False, te=False)
    for plan in (direct, from_launched):
        assert (plan.train_iters, plan.config.image_token_id, plan.config.pad_token_id) == (iters, 32000, 32001)
    assert direct.resolved_config() == from_launched.resolved_config()
    # What was filled in, as run.py shows it.
    notes = [f"token ids from {inputs.checkpoint / 'tokenizer'}: image 32000, pad 32001"]
    if not trainer_extra:
        notes.append("125 iterations = one epoch of 1000 training samples at global batch 8 "
                     "(change with -- --train-iters N or -- --epochs E)")
    assert list(direct.notes) == notes
    assert [f"run.py: {note}" for note in notes] == [line for line in dry.stderr.splitlines() if "token ids" in line
                                                     or "one epoch" in line]


@pytest.mark.parametrize("case", ["init without tokenizer", "tokenizer of another model", "no training samples"])
def test_an_error_reads_the_same_from_both(launcher, inputs, tmp_path, case):
    args = {
        "init without tokenizer": ["--data-path", inputs.data, "--init"],
        "tokenizer of another model": ["--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data,
                                       "--tokenizer-load-dir", write_tokenizer(tmp_path / "other", {"<image>": 5, "<pad>": 6})],
        "no training samples": ["--megatron-load-dir", inputs.checkpoint, "--data-path",
                                write_prepared_dataset(tmp_path / "val_only", {"a.tar": 5}, {"train": [], "val": ["a.tar"]})],
    }[case]
    from_launcher = launcher.run(*args)
    from_trainer = run_script("train/pretrain_llava.py", *args, check=False, timeout=100, env=child_env())
    assert from_launcher.returncode == from_trainer.returncode == 2
    assert from_launcher.stderr.startswith("error: ") and "\n" not in from_launcher.stderr.strip()
    assert from_trainer.stderr == from_launcher.stderr
    assert launcher.records() == []


def test_a_metadataset_with_join_entries_trains_for_the_given_iterations(launcher, inputs, tmp_path):
    """Joined samples cannot be counted: with --train-iters both plan it; without, both say to give it."""
    import yaml

    joined = tmp_path / "joined.yaml"
    joined.write_text(yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {
        "train": {"join": [{"path": str(inputs.data)}, {"path": str(inputs.data)}]}}}))
    common = ["--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(joined), "--stage", "2"]
    dry = launcher.run("--dry-run", *common, "--", "--train-iters", "3")
    assert dry.returncode == 0, dry.stderr
    plan = make_plan(_trainer.main([*common, "--train-iters", "3"], standalone_mode=False), world_size=1,
                     on_gpu=False, te=False)
    assert plan.train_iters == 3
    refused = launcher.run("--dry-run", *common)
    assert refused.returncode != 0
    assert "cannot count samples of a metadataset with join entries; give --train-iters" in refused.stderr


def test_with_packing_one_epoch_is_every_training_sample_once_not_iterations(launcher, inputs):
    common = ["--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data), "--stage", "2",
              "--global-batch-size", "8"]
    dry = launcher.run("--dry-run", *common, "--", "--packing-seq-length", "512")
    assert dry.returncode == 0, dry.stderr
    _, launched = split_torchrun(shlex.split(dry.stdout)[1:])
    plan = make_plan(launched, world_size=1, on_gpu=False, te=False)
    # A packed row holds several samples: the run ends after the 1000 samples, at most 125 iterations.
    assert (launched.epochs, launched.train_iters, plan.epoch_samples, plan.train_iters) == (1.0, None, 1000, 125)
    note = ("1 epoch(s) = each of the 1000 training samples 1 time(s): with packing a global batch of 8 rows holds "
            "several samples, so the run ends when they are trained (at most 125 iterations) and the LR schedule "
            "counts samples (change with -- --train-iters N or -- --epochs E)")
    assert f"run.py: {note}" in dry.stderr.splitlines()


def test_an_epoch_of_a_weighted_blend_is_said_to_be_samples_drawn_by_weight(launcher, inputs):
    dry = launcher.run("--dry-run", "--no-memory-check", "--megatron-load-dir", str(inputs.checkpoint), "--data-path",
                       str(inputs.blend), "--stage", "2", "--", "--packing-seq-length", "512", "--epochs", "1")
    assert dry.returncode == 0, dry.stderr
    # 1000 + 300 training samples (one pass over each member), drawn at random by the weights 3 and 1.
    assert (f"run.py: --data-path {inputs.blend} blends by weight: an epoch there is 1300 samples drawn at random by "
            "weight, not each sample once (blend_epochized with repetitions reads exact passes)") in dry.stderr.splitlines()
