"""DPO (--stage dpo) equals TRL's DPOTrainer: for the same HF model, reference, pairs and beta, the
trainer's objective gives TRL's loss and metrics on the global batch at TP1, TP2, PP2 (packed), two
data-parallel replicas with LoRA, and for OneVision with an anyres image and a video at TP2; and
(but under LoRA, whose adapters PEFT initialises otherwise) one Adam step from the same weights
gives TRL's next loss. The vision tower runs
once per pair (counted), and the reference under LoRA is the base model (adapters off)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import run_ranks

WORKER = str(Path(__file__).with_name("dpo_worker.py"))
LR = 1e-3
# The first step sees the checkpoint's own weights on both sides: float noise only. After one Adam
# step the two models differ by Adam's first update, lr x g / (|g| + eps) per weight, which turns
# float noise on a near-zero gradient into a difference of up to lr: a looser bound.
FIRST, AFTER = 1e-5, 2e-3

# Each layout also runs one of the losses (TRL's loss_type, label_smoothing, RPO's weight).
LAYOUTS = {
    "tp1": (1, {}),
    "tp2-micro-batch-2-ipo": (2, {"tp": 2, "micro_batch_size": 2, "dpo_loss": "ipo"}),
    "pp2-packed-robust": (2, {"pp": 2, "packing_seq_length": 256, "dpo_loss": "robust", "dpo_label_smoothing": 0.1}),
    "lora-dp2-dist-optim": (2, {"lora_rank": 4, "lora_alpha": 8.0, "dist_optim": True, "micro_batch_size": 2}),
    # OneVision: a pair with an anyres image, one with a video, at TP2.
    "onevision-tp2-rpo": (2, {"tp": 2, "pairs": "tiled", "seq_length": 2048, "rpo_alpha": 0.5}),
}
BETA = 0.1


def _trl_loss(options: dict) -> dict:
    return {"beta": BETA, "loss_type": options.get("dpo_loss", "sigmoid"),
            "label_smoothing": options.get("dpo_label_smoothing", 0.0), "rpo_alpha": options.get("rpo_alpha")}


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _hf(llava_dir: Path):
    from megatron_ext import families

    return families.load_model(llava_dir, "--hf-dir", dtype=torch.float32).eval()


@pytest.fixture
def checkpoints(request, megatron_clip, llava_clip):
    """(Megatron checkpoint, its HF LLaVA, the HF side's tiled layout) of a layout's model."""
    if "onevision" not in request.node.callspec.params["layout"]:
        return megatron_clip, llava_clip, None
    from megatron_ext.data.anyres import FeatureLayout
    from megatron_ext.hf.processors import load_processor

    hf = request.getfixturevalue("llava_onevision_siglip")
    return request.getfixturevalue("megatron_onevision"), hf, FeatureLayout.of(load_processor(hf, "--hf-dir"))


def _close(ours: dict, theirs: dict, rtol: float) -> list[str]:
    return [f"{name}: ours {ours[name]:.7g}, TRL {theirs[name]:.7g}" for name in theirs
            if name in ours and abs(ours[name] - theirs[name]) > rtol * max(1.0, abs(theirs[name]))]


def _first(metrics: dict) -> dict:
    """The first step's metrics but the reward accuracy: policy and reference are the same weights, so
    every reward is 0 up to float noise (the two forward passes run apart) and a pair's "chosen
    beats rejected" is a coin toss in that noise, on either side."""
    return {name: value for name, value in metrics.items() if name != "rewards/accuracies"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_step_equals_trl(layout, tmp_path, checkpoints, preference_data):
    from tests.reference.trl_dpo import per_pair_logps, trl_dpo_step

    megatron, hf_dir, tiled = checkpoints
    nproc, options = LAYOUTS[layout]
    run_ranks(nproc, WORKER, megatron, preference_data, tmp_path, json.dumps(options), timeout=300)
    ours = json.loads((tmp_path / "result.json").read_text())
    micro_batches = torch.load(tmp_path / "micro_batches.pt", weights_only=False)
    config = json.loads((hf_dir / "config.json").read_text())
    space = {"image_token_index": config["image_token_index"], "img_seq_len": ours["img_seq_len"], "tiled": tiled}

    # Each pair's images went through the tower once per forward pass (LoRA: the reference's too), not
    # once per sequence; the frozen tower took all of a pass's images in one forward (`step_vision`).
    passes = 2 if "lora" in layout else 1
    assert sum(ours["tower_batches"]) == sum(ours["images"]) * passes
    assert len(ours["tower_batches"]) == passes
    assert sum(int(b["images"].shape[0]) for b in micro_batches) * 2 == \
        sum(int(b["image_index"].shape[0]) for b in micro_batches)

    policy, reference = _hf(hf_dir), _hf(hf_dir)
    if "lora" in layout:
        # Adapters start at zero (B = 0): the first step's policy is the base. After it, our reference
        # must still be the base (adapters off): its log-probs are what our rewards are measured from.
        before, _ = trl_dpo_step(policy, reference, micro_batches, **space, **_trl_loss(options), lr=0.0,
                                 optimizer="sgd")
        assert not _close(ours["first"], _first(before), FIRST), _close(ours["first"], _first(before), FIRST)
        base = per_pair_logps(reference, micro_batches, **space).mean(0)
        after = ours["after"]
        ref_chosen = after["logps/chosen"] - after["rewards/chosen"] / BETA
        ref_rejected = after["logps/rejected"] - after["rewards/rejected"] / BETA
        assert abs(ref_chosen - float(base[0])) < 1e-4 and abs(ref_rejected - float(base[1])) < 1e-4
        assert after["loss"] < ours["first"]["loss"]
        return
    policy.model.vision_tower.requires_grad_(False)  # --stage dpo trains the projector and the LM
    before, after = trl_dpo_step(policy, copy.deepcopy(reference), micro_batches, **space, **_trl_loss(options), lr=LR,
                                 optimizer="adamw")
    assert not _close(ours["first"], _first(before), FIRST), _close(ours["first"], _first(before), FIRST)
    assert not _close(ours["after"], after, AFTER), _close(ours["after"], after, AFTER)
    assert after["loss"] < before["loss"]
