"""Bad trainer input fails before training starts, with one line naming the flag."""

from __future__ import annotations

import pytest

from tests.helpers import child_env, run_script
from tests.train.conftest import trainer_args


def _fails(tmp_path, *args, env=None):
    proc = run_script("train/pretrain_llava.py", *args, check=False, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "save").exists()
    return lines[-1]


@pytest.mark.timeout(300)
def test_bad_input_is_one_line_before_training(tmp_path, megatron_clip, train_data):
    args = lambda **kw: trainer_args(megatron_clip, train_data, tmp_path / "save", **kw)  # noqa: E731

    line = _fails(tmp_path, *args(global_batch_size=5))
    assert "--global-batch-size 5 must be a multiple of --micro-batch-size 2" in line

    # As if started by torchrun with 3 processes: TP 2 cannot divide them.
    line = _fails(tmp_path, *args(tp=2), env=child_env(WORLD_SIZE="3", RANK="0"))
    assert line == "error: --tp 2 x --pp 1 = 2 does not divide the number of processes (3)"

    not_a_checkpoint = tmp_path / "plain"
    not_a_checkpoint.mkdir()
    line = _fails(tmp_path, *trainer_args(not_a_checkpoint, train_data, tmp_path / "save"))
    assert line.startswith(f"error: --megatron-load-dir {not_a_checkpoint} is not a megatron_ext checkpoint")

    line = _fails(tmp_path, *args(fp8=True))
    assert "--fp8 needs Transformer Engine" in line and "pip install" in line

    line = _fails(tmp_path, *args(eval_generate_samples=4))
    assert line == "error: --eval-generate-samples needs --eval-interval (evaluations are when answers are generated)"


def test_plan_derives_stage_defaults_and_iterations(megatron_clip, train_data):
    from megatron_ext.train.options import TrainConfig
    from megatron_ext.train.plan import make_plan

    stage1 = make_plan(TrainConfig(megatron_load_dir=str(megatron_clip), data_path=str(train_data), stage=1,
                                   micro_batch_size=4, epochs=2), world_size=4, on_gpu=False)
    assert (stage1.config.global_batch_size, stage1.config.lr, stage1.config.freeze_lm) == (256, 1e-3, True)
    assert stage1.data_parallel_size == 4 and stage1.num_microbatches == 16
    assert stage1.train_iters == 1  # 2 epochs of 80 samples in batches of 256
    stage2 = make_plan(TrainConfig(megatron_load_dir=str(megatron_clip), data_path=str(train_data), stage=2,
                                   global_batch_size=8, epochs=1.5, tp=2), world_size=2, on_gpu=True)
    assert (stage2.config.lr, stage2.config.freeze_lm, stage2.dtype) == (2e-5, False, "bfloat16")
    assert stage2.train_iters == 15  # ceil(1.5 * 80 / 8)
