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


def test_the_host_reads_variant_trains_the_same_losses():
    """--host-reads (megatron-core's preprocessing and gradient norm, the A/B baseline) and the
    default path compute the same step: same losses on the CPU in fp32. Both take logits at every
    position, as megatron-core's preprocessing must (logits where a loss is taken multiply other
    shapes, equal within float rounding: tests/train/test_parallel_losses.py)."""
    ours, theirs = _bench("--no-logits-where-loss"), _bench("--host-reads")
    assert (ours["loss_first"], ours["loss_last"]) == (theirs["loss_first"], theirs["loss_last"])


def test_a_frozen_vision_tower_runs_once_per_step_with_the_same_losses():
    """The stage-2 tower is frozen: one forward over the step's 16 images instead of one per micro
    batch (`model/step_vision.py`), and the model takes those features instead of calling it again."""
    once, per_micro_batch = _bench(), _bench("--vision-per-micro-batch")
    assert once["vision_tower_forwards_per_step"] == 1
    assert per_micro_batch["vision_tower_forwards_per_step"] == per_micro_batch["micro_batches_per_step"] > 1
    assert (once["loss_first"], once["loss_last"]) == (per_micro_batch["loss_first"], per_micro_batch["loss_last"])


def test_a_longer_pack_trains_the_same_samples_in_fewer_micro_batches():
    """--seq-length packs the step's samples into longer sequences: the same positions, fewer micro
    batches, and (fp32, CPU) the same first loss, since a pack's samples never attend to each other."""
    default, longer = _bench(), _bench("--seq-length", "1024")
    assert (default["seq_length"], longer["seq_length"]) == (256, 1024)
    assert longer["micro_batches_per_step"] < default["micro_batches_per_step"]
    assert longer["tokens_per_s"] * longer["step_time_s"] == pytest.approx(
        default["tokens_per_s"] * default["step_time_s"])
    assert longer["loss_first"] == pytest.approx(default["loss_first"], rel=1e-6)


@pytest.mark.timeout(200)
def test_the_profile_charges_every_kernel_to_a_category_and_phase():
    proc = run_python("bench/gpu_profile.py", "--preset", "tiny", timeout=180)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    table = result["table_ms"]
    # The frozen tower runs forward only; the LM's matrix products run forward and backward.
    assert table["GEMM"]["vit"] > 0 and "backward: vit" not in table["GEMM"]
    assert table["GEMM"]["lm"] > 0 and table["GEMM"]["backward: lm"] > 0
    assert table["GEMM"]["logits+loss"] > 0 and any(row.get("optimizer") for row in table.values())
    charged = sum(ms for row in table.values() for ms in row.values())
    # On the CPU the outermost operators are the "kernels": they tile the busy time exactly.
    assert charged == pytest.approx(result["device_busy_ms"], rel=0.01)
    assert result["device_busy_ms"] + result["device_idle_ms"] == pytest.approx(result["wall_ms"], abs=0.2)
    assert result["micro_batches"] > 1 and [g["gemm"] for g in result["gemm_ceiling"]] == \
        ["qkv", "proj", "fc1", "fc2", "logits"]
    assert "| **total** |" in proc.stdout


@pytest.mark.timeout(200)
def test_the_host_profile_lists_where_one_step_spends_its_host_time():
    proc = run_python("bench/gpu_profile.py", "--preset", "tiny", "--host-functions", "15", timeout=180)
    host = json.loads(proc.stdout.strip().splitlines()[-1])["host_functions"]
    own = [f["own_ms"] for f in host["functions"]]
    assert len(own) == 15 and own == sorted(own, reverse=True) and sum(own) <= host["wall_ms"]
    assert all(f["calls"] > 0 and f["cumulative_ms"] >= f["own_ms"] for f in host["functions"])
    # The backward pass is one C call whose own time holds all of autograd's kernels.
    assert any("run_backward" in f["function"] for f in host["functions"])
    assert proc.stdout.count("\n| ") == 15 + 1


def test_transformers_runs_on_the_same_samples_for_a_side_by_side_ratio():
    ours, theirs = _bench(), _bench("--hf")
    assert theirs["implementation"] == "transformers" and theirs["tokens_per_s"] > 0
    # In the same packs: as many micro batches of one row each.
    assert theirs["packing"] and theirs["micro_batches_per_step"] == ours["micro_batches_per_step"]
    # The same synthetic samples: the same language-model positions per step on both sides.
    assert theirs["tokens_per_s"] * theirs["step_time_s"] == pytest.approx(ours["tokens_per_s"] * ours["step_time_s"])
    assert theirs["loss_first"] == pytest.approx(ours["loss_first"], rel=0.05)  # both near ln(vocabulary)


def _summed_token_losses(model, batches: list[dict]) -> tuple[float, int]:
    """transformers' mean loss of each micro batch times its trained tokens, summed; the tokens."""
    import torch

    from bench import gpu_bench

    total, tokens = 0.0, 0
    for batch in batches:
        trained = int((batch["labels"][:, 1:] != -100).sum())
        total += float(gpu_bench.hf_loss(model, batch, torch.device("cpu"))) * trained
        tokens += trained
    return total, tokens


def test_transformers_packed_rows_train_the_same_tokens_as_padded_micro_batches():
    """--hf's packs (one row each, position ids restarting per sample, no padding) give transformers'
    model the same per-token losses as padded rows of one sample each: attention stays within each
    sample, and no sample is trained to predict the next one's first token (fp32, CPU)."""
    import numpy as np
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from bench import gpu_bench
    from megatron_ext import families

    preset = gpu_bench.PRESETS["tiny"]
    hf_config = gpu_bench.llava_config(preset)
    arch = families.read_llava(hf_config)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration._from_config(LlavaConfig(**hf_config), attn_implementation="sdpa").eval()
    samples = gpu_bench.synthetic_samples(preset, arch, np.random.default_rng(0))
    packed = gpu_bench.hf_packed_micro_batches(arch, samples, preset.seq_length)
    assert 1 < len(packed) < len(samples) and all("attention_mask" not in batch for batch in packed)
    with torch.no_grad():
        packed_sum, packed_tokens = _summed_token_losses(model, packed)
        padded_sum, padded_tokens = _summed_token_losses(model, gpu_bench.hf_micro_batches(arch, samples, 1))
    assert packed_tokens == padded_tokens
    assert packed_sum == pytest.approx(padded_sum, rel=1e-5)


def test_liger_asked_for_but_not_installed_is_one_line(monkeypatch):
    from click.testing import CliRunner

    from bench import gpu_bench

    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # its import fails, installed or not
    result = CliRunner().invoke(gpu_bench.main, ["--preset", "tiny", "--hf", "--liger", "--iters", "1", "--warmup", "0"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "Error: --liger: liger-kernel is not installed (pip install liger-kernel)")
