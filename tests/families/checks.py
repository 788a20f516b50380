"""What every new family's tests check end to end: greedy generation from its Megatron checkpoint at
TP2 equals transformers', and that a short stage-2 run trains every tensor but the vision tower's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.eval.test_generate import MAX_NEW_TOKENS, _expected, _requests
from tests.support.helpers import hf_tensors, run_ranks
from tests.support.training import train, trainer_args


def assert_greedy_at_tp2_equals_transformers(hf_dir: Path, tmp_path: Path) -> Path:
    """Converts `hf_dir` to Megatron TP2 (returned) and checks generate.py's tokens there."""
    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.convert.to_megatron import convert as to_megatron
    from tests.support.hf_generate import HFReference

    megatron = to_megatron(hf_dir, tmp_path / "megatron", tp=2, pp=1)
    images = [tmp_path / "images" / "a.png", tmp_path / "images" / "b.png"]
    images[0].parent.mkdir()
    synthetic_image(0).save(images[0])
    synthetic_image(1, size=(90, 40)).save(images[1])
    requests, answers = _requests(tmp_path, images), tmp_path / "answers.jsonl"
    run_ranks(2, "scripts/eval/generate.py", "--megatron-dir", megatron, "--input-jsonl", requests,
                 "--output-jsonl", answers, "--max-new-tokens", MAX_NEW_TOKENS, "--tp", 2, timeout=180)
    expected = _expected(HFReference(hf_dir), images)
    assert [json.loads(line)["token_ids"] for line in answers.read_text().splitlines()] == expected
    assert all(len(ids) == MAX_NEW_TOKENS for ids in expected)
    return megatron


def assert_stage2_trains_all_but_the_tower(hf_dir: Path, megatron: Path, train_data: Path, tmp_path: Path) -> set[str]:
    """A two-step stage-2 run from `megatron` changes exactly the language model's and the
    projector's HF tensors; returns them (normalized names)."""
    from megatron_ext.convert.mapping import normalize_hf_name
    from megatron_ext.convert.to_hf import convert as to_hf

    save = tmp_path / "run"
    train(1, *trainer_args(megatron, train_data, save, stage=2, lr=1e-2, train_iters=2, chat_template="plain"))
    before = {normalize_hf_name(k): v for k, v in hf_tensors(hf_dir).items()}
    after = {normalize_hf_name(k): v for k, v in hf_tensors(to_hf(save, tmp_path / "hf")).items()}
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {n for n in before if n.split(".")[0] in ("language_model", "multi_modal_projector")}
    return changed
