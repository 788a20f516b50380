"""Every script answers bad input with exactly one line on stderr and a non-zero status, never a
traceback or a usage block; under torchrun only rank 0 says it, the other ranks exit quietly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO_ROOT, run, run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

MISSING = "/no/such/place"
# script -> (arguments, what the line must say)
CASES = {
    "convert/build_llava_jp.py": (["--save-dir", "OUT", "--text-model", MISSING], "--text-model"),
    "convert/convert_hf_to_megatron.py": (["--tp", "1", "--pp", "1", "--hf-dir", MISSING, "--megatron-dir", "OUT"],
                                          f"--hf-dir {MISSING}"),
    "convert/convert_megatron_to_hf.py": (["--megatron-dir", MISSING, "--hf-dir", "OUT"], f"--megatron-dir {MISSING}"),
    "convert/compare_hf_megatron.py": (["--hf-dir", MISSING, "--megatron-dir", MISSING], MISSING),
    "data/build_energon_dataset.py": ([f"{MISSING}.json", "--output-dir", "OUT"], f"INPUT {MISSING}.json does not exist"),
    "data/inspect_dataset.py": ([MISSING, "--tokenizer-load-dir", MISSING], f"DATA {MISSING} does not exist"),
    "data/make_synthetic_dataset.py": (["--output-dir", "OUT", "--num-samples", "0"], "--num-samples"),
    "demo/make_tiny_hf_models.py": (["--save-dir", "OUT", "--text-arch", "gpt5"], "--text-arch"),
    "demo/run_demo.py": (["--output-dir", "OUT", "--stage1-iter", "3"], "No such option '--stage1-iter'"),
    "eval/chat.py": (["--megatron-dir", MISSING], f"--megatron-dir {MISSING} does not exist"),
    "eval/evaluate.py": (["--megatron-dir", MISSING, "--data-path", MISSING, "--output-dir", "OUT"],
                         f"--megatron-dir {MISSING} does not exist"),
    "eval/generate.py": (["--megatron-dir", MISSING, "--prompt", "hi"], f"--megatron-dir {MISSING} does not exist"),
    "train/pretrain_llava.py": (["--megatron-load-dir", MISSING, "--data-path", MISSING, "--train-iters", "1"],
                                f"--data-path {MISSING} does not exist"),
    # The same plan refuses it in the same words from run.py as from the trainer.
    "train/run.py": (["--megatron-load-dir", MISSING, "--data-path", MISSING], f"--data-path {MISSING} does not exist"),
}
# An eval command and the trainer: evaluate.py says its error (the same one, from the same
# open_checkpoint) through the same `errors.run_command` as generate.py.
TORCHRUN = ("eval/generate.py", "train/pretrain_llava.py")


def _args(script: str, tmp_path: Path) -> tuple[list[str], str]:
    args, message = CASES[script]
    return [str(tmp_path / "out") if a == "OUT" else a for a in args], message


@pytest.mark.parametrize("script", list(CASES))
def test_bad_input_is_one_line(script, tmp_path):
    args, message = _args(script, tmp_path)
    proc = run_script(script, *args, check=False, timeout=100, fresh=True)
    assert proc.returncode != 0
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", TORCHRUN)
def test_under_torchrun_only_rank_zero_says_it(script, tmp_path):
    args, message = _args(script, tmp_path)
    logs = tmp_path / "logs"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                f"--log-dir={logs}", "--redirects=3", str(REPO_ROOT / "scripts" / script), *args],
               timeout=100, check=False)
    assert proc.returncode != 0
    (rank0,) = logs.glob("**/0/stderr.log")
    (rank1,) = logs.glob("**/1/stderr.log")
    assert rank0.read_text().startswith("error: ") and len(rank0.read_text().splitlines()) == 1, rank0.read_text()
    assert message in rank0.read_text()
    assert rank1.read_text() == ""


def test_parity_with_lora_names_the_extra_that_brings_peft_when_peft_is_missing(tmp_path):
    """peft is the parity extra's, not the base install's: without it, --lora-rank is refused in one
    line before anything converts or trains."""
    code = ("import sys; sys.modules['peft'] = None; from megatron_ext.commands.parity import main; "
            f"sys.argv = ['megatron-ext-parity', '--hf-dir', {str(tmp_path)!r}, '--data-path', {str(tmp_path)!r}, "
            f"'--lora-rank', '8', '--work-dir', {str(tmp_path / 'out')!r}]; main()")
    proc = run([sys.executable, "-c", code], check=False, timeout=100, fresh=True)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "pip install 'megatron-ext[parity]'" in proc.stderr, proc.stderr
    assert not any((tmp_path / "out").iterdir())
