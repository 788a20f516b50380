"""Bad trainer input fails before training starts, with one line naming the flag."""

from __future__ import annotations

import pytest

from tests.support.helpers import child_env, run_script
from tests.support.training import trainer_args

# (trainer options, extra environment, the one line it must print)
CASES = {
    "global batch": (dict(global_batch_size=5), {}, "--global-batch-size 5 must be a multiple of --micro-batch-size 2"),
    # As if started by torchrun with 3 processes: TP 2 cannot divide them.
    "layout": (dict(tp=2), {"WORLD_SIZE": "3", "RANK": "0"},
               "error: --tp 2 x --pp 1 = 2 does not divide the number of processes (3)"),
    "not a checkpoint": (dict(megatron_load_dir="PLAIN"), {}, "is not a megatron_ext checkpoint"),
    "fp8 without TE": (dict(fp8=True), {}, "--fp8 needs Transformer Engine with CUDA"),
    "te without TE": (dict(attention_backend="te"), {}, "--attention-backend te needs Transformer Engine"),
    "generation needs evaluations": (dict(eval_generate_samples=4), {},
                                     "error: --eval-generate-samples needs --eval-interval (evaluations are when "
                                     "answers are generated)"),
    "benchmarks need evaluations": (dict(eval_benchmarks="textvqa_val"), {},
                                    "error: --eval-benchmarks needs --eval-interval"),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_before_training(tmp_path, megatron_clip, train_data, name):
    options, env, message = CASES[name]
    plain = tmp_path / "plain"
    plain.mkdir()
    options = {k: plain if v == "PLAIN" else v for k, v in options.items()}
    checkpoint = options.pop("megatron_load_dir", megatron_clip)
    proc = run_script("train/pretrain_llava.py", *trainer_args(checkpoint, train_data, tmp_path / "save", **options),
                      check=False, timeout=120, env=child_env(**env), fresh=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert not (tmp_path / "save").exists()


@pytest.mark.multiprocess
def test_pairs_train_with_stage_dpo_and_only_with_it(megatron_clip, train_data, preference_data):
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.errors import UserError

    def plan(data, stage, **options):
        return make_plan(TrainConfig(megatron_load_dir=str(megatron_clip), data_path=str(data), stage=stage, **options),
                         world_size=1, on_gpu=False)

    dpo = plan(preference_data, "dpo")
    assert (dpo.config.global_batch_size, dpo.config.lr, dpo.config.freeze_lm) == (64, 5e-7, False)
    with pytest.raises(UserError, match=f"--stage dpo trains on preference pairs; --data-path {train_data} holds "
                                        "conversations: build pairs with megatron-ext-data build --task preference"):
        plan(train_data, "dpo")
    with pytest.raises(UserError, match=f"--data-path {preference_data} holds preference pairs: train on them with "
                                        "--stage dpo"):
        plan(preference_data, 2)
    with pytest.raises(UserError, match="--dpo-label-smoothing applies to --dpo-loss robust"):
        plan(preference_data, "dpo", dpo_label_smoothing=0.1)


@pytest.mark.multiprocess
def test_plan_derives_stage_defaults_and_iterations(megatron_clip, train_data):
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan

    stage1 = make_plan(TrainConfig(megatron_load_dir=str(megatron_clip), data_path=str(train_data), stage=1,
                                   micro_batch_size=4, epochs=2), world_size=4, on_gpu=False)
    assert (stage1.config.global_batch_size, stage1.config.lr, stage1.config.freeze_lm) == (256, 1e-3, True)
    assert stage1.execution.data_parallel_size == 4 and stage1.num_microbatches == 16
    assert stage1.train_iters == 1  # 2 epochs of 80 samples in batches of 256
    stage2 = make_plan(TrainConfig(megatron_load_dir=str(megatron_clip), data_path=str(train_data), stage=2,
                                   global_batch_size=8, epochs=1.5, tp=2), world_size=2, on_gpu=True)
    assert (stage2.config.lr, stage2.config.freeze_lm, stage2.dtype) == (2e-5, False, "bfloat16")
    assert stage2.train_iters == 15  # ceil(1.5 * 80 / 8)
