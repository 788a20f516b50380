"""DPO on a Qwen2-shaped LLaVA with a tokenizer as Qwen2's (byte-level BPE, ChatML), and on the tiny
Qwen2.5-VL and Qwen3-VL with the same kind of tokenizer, equals TRL's DPOTrainer tokenizing and
collating the same conversational vision pairs itself (its processor, its chat template, its
collator): our pair batches are the batch TRL builds (ids, attention and completion masks, pixels;
the Qwen-VLs' grids), and our trainer's loss, rewards and log-probs equal TRL's on its own batch at
each of three Adam steps and after the last."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch

from tests.train.dpo_worker import micro_batches_of, native_pairs, pairs

WORKER = str(Path(__file__).with_name("dpo_worker.py"))
BETA, LR, STEPS = 0.1, 1e-3, 3


def _hf(llava_dir: Path):
    from megatron_ext import families

    return families.load_model(llava_dir, "--hf-dir", dtype=torch.float32).eval()


def _space(llava_dir: Path) -> dict:
    from megatron_ext.families import read_llava

    arch = read_llava(json.loads((llava_dir / "config.json").read_text()))
    return {"image_token_index": arch.image_token_index, "img_seq_len": arch.img_seq_len}


def _our_micro_batches(llava_dir: Path) -> list[dict]:
    from megatron_ext.data.pairs import PairTaskEncoder
    from megatron_ext.families import read_llava

    arch = read_llava(json.loads((llava_dir / "config.json").read_text()))
    encoder = PairTaskEncoder.for_model(str(llava_dir), arch, seq_length=256)
    return micro_batches_of(encoder, [encoder.postencode_sample(encoder.preencode_sample(p)) for p in pairs()], 1, False)


def _rows(batch: dict, row: int) -> tuple[list[int], list[int]]:
    """A row's real tokens and their completion mask (the two sides pad differently)."""
    real = batch["attention_mask"][row].bool()
    return batch["input_ids"][row][real].tolist(), batch["completion_mask"][row][real].tolist()


def test_our_pair_batches_are_the_batch_trl_collates_from_the_same_pairs(tmp_path, llava_qwen2_chatml, record_property):
    from tests.reference.trl_dpo import dpo_trainer, trl_batch, trl_dpo_metrics, trl_examples

    micro_batches, space = _our_micro_batches(llava_qwen2_chatml), _space(llava_qwen2_chatml)
    ours = trl_batch(micro_batches, **space)
    trainer = dpo_trainer(_hf(llava_qwen2_chatml), None, str(tmp_path), beta=BETA, loss_type="sigmoid",
                          label_smoothing=0.0, rpo_alpha=None)
    theirs = trainer.data_collator(trl_examples(pairs()))
    assert ours["input_ids"].shape[0] == theirs["input_ids"].shape[0] == 2 * len(pairs())
    for row in range(ours["input_ids"].shape[0]):
        assert _rows(ours, row) == _rows(theirs, row)
    # Each answer's completion ends with ChatML's "\n" after <|im_end|>, as TRL's does.
    tokenizer = trainer.processing_class.tokenizer
    ids, mask = _rows(theirs, 0)
    assert tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m][-2:]) == ["<|im_end|>", "Ċ"]
    assert (ours["pixel_values"] - theirs["pixel_values"]).abs().max() < 1e-6
    # TRL's loss and metrics on either batch (policy and reference: the checkpoint).
    policy = _hf(llava_qwen2_chatml)
    on_ours = trl_dpo_metrics(policy, copy.deepcopy(policy), micro_batches, **space)
    on_theirs = trl_dpo_metrics(policy, copy.deepcopy(policy), micro_batches, **space, examples=trl_examples(pairs()))
    record_property("summary", f"logps/chosen ours {on_ours['logps/chosen']:.7g} TRL {on_theirs['logps/chosen']:.7g}, "
                               f"logps/rejected ours {on_ours['logps/rejected']:.7g} TRL {on_theirs['logps/rejected']:.7g}")
    for name in ("loss", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"):
        assert on_ours[name] == pytest.approx(on_theirs[name], rel=1e-6, abs=1e-6), name


def _relative(ours: dict, theirs: dict, names) -> dict:
    return {name: abs(ours[name] - theirs[name]) / max(1.0, abs(theirs[name])) for name in names}


def _assert_steps_equal(ours: list[dict], theirs: list[dict], record_property) -> None:
    """What our trainer logs of TRL's metrics, within 1e-4 relative before each step and after the last.
    Step 1: policy and reference are the same weights, so a reward's sign (the accuracy) is float
    noise on both sides."""
    from tests.reference.trl_dpo import METRICS

    names = [n for n in ("loss", *METRICS) if n in ours[0]]
    noise = [n for n in names if n != "rewards/accuracies"]
    apart = [_relative(o, t, noise if i == 0 else names) for i, (o, t) in enumerate(zip(ours, theirs))]
    record_property("summary", "largest relative difference per step: "
                    + ", ".join(f"{max(a.values()):.2g}" for a in apart) + "; "
                    + " | ".join(", ".join(f"{n} {o[n]:.7g}/{t[n]:.7g}" for n in names) for o, t in zip(ours, theirs)))
    assert len(ours) == len(theirs) == STEPS + 1
    assert all(max(a.values()) < 1e-4 for a in apart), apart


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_three_dpo_steps_equal_trl_tokenizing_the_pairs_itself(tmp_path, megatron_qwen2_chatml, llava_qwen2_chatml,
                                                               preference_data, record_property):
    from tests.reference.trl_dpo import trl_dpo_step, trl_examples
    from tests.support.helpers import run_ranks

    run_ranks(1, WORKER, megatron_qwen2_chatml, preference_data, tmp_path, json.dumps({"steps": STEPS}), timeout=400)
    result = json.loads((tmp_path / "result.json").read_text())
    ours = [*result["steps"], result["after"]]
    policy = _hf(llava_qwen2_chatml)
    policy.model.vision_tower.requires_grad_(False)  # --stage dpo trains the projector and the LM
    theirs = trl_dpo_step(policy, _hf(llava_qwen2_chatml), [], **_space(llava_qwen2_chatml), lr=LR, steps=STEPS,
                          optimizer="adamw", beta=BETA, examples=trl_examples(pairs()))
    _assert_steps_equal(ours, theirs, record_property)
    assert [t["loss"] for t in theirs] == sorted((t["loss"] for t in theirs), reverse=True)


# Each Qwen-VL family's tiny model writer and TRL processor (tests.support).
QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def qwen_hf(request, tmp_path_factory):
    """(the family's tests.support module, its tiny model with a tokenizer that adds no BOS, as Qwen's:
    TRL tokenizes without special tokens)."""
    support = importlib.import_module(f"tests.support.{request.param}")
    return support, support.write_tiny_model(tmp_path_factory.mktemp(f"{request.param}_hf"), bos=False)


def _qwen_space(hf_dir: Path) -> dict:
    from tests.reference.trl_dpo import NativeSpace

    config = json.loads((hf_dir / "config.json").read_text())
    return {"image_token_index": config["image_token_id"], "img_seq_len": 1,
            "native": NativeSpace(config["video_token_id"], config["vision_config"]["spatial_merge_size"])}


def _qwen_trl(policy, reference, support, hf_dir: Path, output_dir: str):
    from tests.reference.trl_dpo import dpo_trainer

    return dpo_trainer(policy, reference, output_dir, beta=BETA, loss_type="sigmoid", label_smoothing=0.0,
                       rpo_alpha=None, processor=support.tiny_processor(hf_dir))


def test_our_qwen_vl_pair_batches_are_the_batch_trl_collates_from_the_same_pairs(tmp_path, qwen_hf):
    """Each pair's images are held once and shown at both sequences' image runs (`image_uses`)."""
    from megatron_ext import families
    from megatron_ext.data.native_resolution_pairs import NativeResolutionPairTaskEncoder
    from tests.reference.trl_dpo import trl_batch, trl_examples

    support, qwen_hf = qwen_hf
    encoder = NativeResolutionPairTaskEncoder.for_model(
        str(qwen_hf), families.read_model(json.loads((qwen_hf / "config.json").read_text())), seq_length=256)
    encoded = [encoder.preencode_sample(p) for p in native_pairs()]
    micro_batches = micro_batches_of(encoder, encoded, 1, False)
    assert [b["image_grid_thw"].shape[0] for b in micro_batches] == [1, 2, 1, 0]
    assert [b["image_uses"].tolist() for b in micro_batches] == [[0, 0], [0, 1, 0, 1], [0, 0], []]
    # Packed (--packing-seq-length), each pair's uses count from its images' place in the row.
    packed = encoder.batch([encoder.pack_selected_samples(encoded[:3])]).as_dict()
    assert packed["image_uses"].tolist() == [0, 0, 1, 2, 1, 2, 3, 3] and int(packed["segment_ids"].max()) == 6
    ours = trl_batch(micro_batches, **_qwen_space(qwen_hf))
    theirs = _qwen_trl(_hf(qwen_hf), _hf(qwen_hf), support, qwen_hf, str(tmp_path)).data_collator(trl_examples(native_pairs()))
    assert ours["input_ids"].shape[0] == theirs["input_ids"].shape[0] == 2 * len(native_pairs())
    for row in range(ours["input_ids"].shape[0]):
        assert _rows(ours, row) == _rows(theirs, row)
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert (ours["pixel_values"] - theirs["pixel_values"]).abs().max() < 1e-6


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_three_qwen_vl_dpo_steps_equal_trl_tokenizing_the_pairs_itself(tmp_path, qwen_hf, preference_data,
                                                                       record_property):
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.verify.hf_loop import frozen
    from tests.reference.trl_dpo import trl_dpo_step, trl_examples
    from tests.support.helpers import run_ranks

    support, qwen_hf = qwen_hf
    checkpoint = convert(qwen_hf, tmp_path / "megatron", 1, 1)
    run_ranks(1, WORKER, checkpoint, preference_data, tmp_path, json.dumps({"steps": STEPS, "pairs": "native"}),
              timeout=400)
    result = json.loads((tmp_path / "result.json").read_text())
    ours = [*result["steps"], result["after"]]
    policy = _hf(qwen_hf)
    for name, param in policy.named_parameters():  # --stage dpo trains the decoder and the merger
        param.requires_grad_(not frozen(name, 2, unfreeze_vit=False))
    # TRL's collator makes its batch: the image token is all `trl_dpo_step` asks of the model's space.
    theirs = trl_dpo_step(policy, _hf(qwen_hf), [], image_token_index=_qwen_space(qwen_hf)["image_token_index"],
                          img_seq_len=1, lr=LR, steps=STEPS, optimizer="adamw",
                          beta=BETA, examples=trl_examples(native_pairs()), processor=support.tiny_processor(qwen_hf))
    _assert_steps_equal(ours, theirs, record_property)
    assert theirs[-1]["loss"] < 0.01 * theirs[0]["loss"]  # Adam at 1e-3 overshoots on the way (step 2's loss rises)
