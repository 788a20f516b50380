"""tests.reference.trl_dpo: TRL's DPO numbers on our pair micro batches, checked against the
plain HF model's log-probs and DPO's definitions."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tests.reference.trl_dpo import per_pair_logps, trl_batch, trl_dpo_metrics, trl_dpo_step

BETA = 0.1


def pair_batch(image_token: int, image_size: int, rows: list[list[tuple[int, int, int]]], seed: int = 0) -> dict:
    """A pair micro batch: per row, its pairs as (prompt length, chosen answer length, rejected answer
    length); every prompt holds one image (its pair's), after its first token. Rows are padded by 3."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(5, 600, (n,), generator=gen)

    built, image_index, pairs = [], [], 0
    for row in rows:
        ids, loss_mask, segments = [], [], []
        for prompt_len, *answer_lens in row:
            prompt = torch.cat([text(1), torch.tensor([image_token]), text(prompt_len - 2)])
            for answer_len in answer_lens:
                seq = torch.cat([prompt, text(answer_len)])
                mask = torch.zeros(len(seq))
                mask[len(prompt) - 1:-1] = 1  # position t trains the token at t + 1
                ids.append(seq)
                loss_mask.append(mask)
                segments.append(torch.full((len(seq),), len(segments) + 1))
                image_index.append(pairs)
            pairs += 1
        built.append((torch.cat(ids), torch.cat(loss_mask), torch.cat(segments)))
    width = max(len(ids) for ids, _, _ in built) + 3
    batch = {"input_ids": torch.zeros((len(rows), width), dtype=torch.long),
             "labels": torch.zeros((len(rows), width), dtype=torch.long),
             "loss_mask": torch.zeros((len(rows), width)),
             "segment_ids": torch.zeros((len(rows), width), dtype=torch.long)}
    for r, (ids, mask, segments) in enumerate(built):
        n = len(ids)
        batch["input_ids"][r, :n], batch["loss_mask"][r, :n], batch["segment_ids"][r, :n] = ids, mask, segments
        batch["labels"][r, :n - 1] = ids[1:]
    batch["images"] = torch.randn((pairs, 3, image_size, image_size), generator=gen)
    batch["image_index"] = torch.tensor(image_index)
    batch["media_layout"] = torch.zeros((0, 4), dtype=torch.long)
    return batch


def load(path):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)


@pytest.fixture
def setup(llava_clip):
    """(model, micro batches, token-space kwargs): two micro batches, three pairs (two packed in one row)
    whose chosen and rejected answers differ in length."""
    model = load(llava_clip)
    config = model.config
    assert not 5 <= config.image_token_id < 600  # pair_batch's text tokens
    size = config.vision_config.image_size
    batches = [pair_batch(config.image_token_id, size, [[(6, 4, 7), (5, 3, 2)]], seed=1),
               pair_batch(config.image_token_id, size, [[(7, 5, 3)]], seed=2)]
    space = {"image_token_index": config.image_token_id, "img_seq_len": config.image_seq_length}
    return model, batches, space


def perturbed(model, scale=0.02, seed=3):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


def test_trl_batch_lays_out_chosen_then_rejected_rows(setup):
    _, batches, space = setup
    batch = trl_batch(batches, **space)
    ids, completion = batch["input_ids"], batch["completion_mask"]
    assert ids.shape[0] == 6  # 3 pairs: chosen 1..3, rejected 1..3
    # Each row: its answer tokens, then right padding only.
    assert completion.sum(1).tolist() == [4, 3, 5, 7, 2, 3]
    lengths = batch["attention_mask"].sum(1)
    assert (batch["attention_mask"] == (torch.arange(ids.shape[1]) < lengths[:, None])).all()
    assert ((ids == space["image_token_index"]).sum(1) == space["img_seq_len"]).all()
    # Each pair's image for its chosen row and again for its rejected row.
    images = torch.cat([batches[0]["images"], batches[1]["images"]])
    assert torch.equal(batch["pixel_values"], images[[0, 1, 2, 0, 1, 2]])


def test_reference_equal_to_policy_gives_log_2(setup):
    model, batches, space = setup
    metrics = trl_dpo_metrics(model, copy.deepcopy(model), batches, **space, beta=BETA)
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[key] == pytest.approx(0, abs=1e-6)
    assert metrics["rewards/accuracies"] == 0


def test_logps_and_rewards_agree_with_the_plain_model(setup):
    model, batches, space = setup
    reference = perturbed(model)
    policy_logps, ref_logps = per_pair_logps(model, batches, **space), per_pair_logps(reference, batches, **space)
    metrics = trl_dpo_metrics(model, reference, batches, **space, beta=BETA)
    ratios = policy_logps - ref_logps
    delta = ratios[:, 0] - ratios[:, 1]
    assert metrics["logps/chosen"] == pytest.approx(policy_logps[:, 0].mean().item(), abs=1e-5)
    assert metrics["logps/rejected"] == pytest.approx(policy_logps[:, 1].mean().item(), abs=1e-5)
    assert metrics["rewards/margins"] == pytest.approx((BETA * delta).mean().item(), abs=1e-5)
    assert metrics["rewards/accuracies"] == pytest.approx((delta > 0).float().mean().item())
    assert metrics["loss"] == pytest.approx(-F.logsigmoid(BETA * delta).mean().item(), abs=1e-5)


def test_peft_policy_without_reference_uses_its_adapters_off(setup, llava_clip):
    from peft import LoraConfig, get_peft_model

    model, batches, space = setup
    base = copy.deepcopy(model)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    implicit = trl_dpo_metrics(policy, None, batches, **space, beta=BETA)
    explicit = trl_dpo_metrics(policy, base, batches, **space, beta=BETA)
    assert implicit["rewards/margins"] != pytest.approx(0, abs=1e-4)  # the adapters change the log-probs
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert implicit[key] == pytest.approx(explicit[key], abs=1e-6)
    ratios = per_pair_logps(policy, batches, **space) - per_pair_logps(base, batches, **space)
    assert implicit["rewards/chosen"] == pytest.approx(BETA * ratios[:, 0].mean().item(), abs=1e-5)
    assert "ref" not in policy.peft_config


@pytest.mark.parametrize("loss_type,label_smoothing,rpo_alpha", [("ipo", 0.0, None), ("robust", 0.1, None),
                                                                  ("sigmoid", 0.0, 0.5)])
def test_losses_follow_their_definitions(setup, loss_type, label_smoothing, rpo_alpha):
    """IPO divides each log-ratio by its answer's length; robust DPO unbiases label smoothing; RPO adds
    alpha x the mean NLL over all chosen answer tokens of the batch (a token mean, not a pair mean)."""
    model, batches, space = setup
    reference = perturbed(model)
    logps = per_pair_logps(model, batches, **space)
    ratios = logps - per_pair_logps(reference, batches, **space)
    tokens = trl_batch(batches, **space)["completion_mask"].sum(1).view(2, -1).T  # [P, (chosen, rejected)]
    delta = BETA * (ratios[:, 0] - ratios[:, 1])
    if loss_type == "ipo":
        per_token = ratios / tokens
        expected = ((per_token[:, 0] - per_token[:, 1]) - 1 / (2 * BETA)) ** 2
    elif loss_type == "robust":
        s = label_smoothing
        expected = (-(1 - s) * F.logsigmoid(delta) + s * F.logsigmoid(-delta)) / (1 - 2 * s)
    else:
        expected = -F.logsigmoid(delta) - rpo_alpha * logps[:, 0].sum() / tokens[:, 0].sum()
    metrics = trl_dpo_metrics(model, reference, batches, **space, beta=BETA, loss_type=loss_type,
                              label_smoothing=label_smoothing, rpo_alpha=rpo_alpha)
    assert metrics["loss"] == pytest.approx(expected.mean().item(), abs=1e-5)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 1e-2), ("adamw", 1e-4)])
def test_one_step_lowers_the_loss(setup, optimizer, lr):
    model, batches, space = setup
    reference = perturbed(model)
    fresh = trl_dpo_metrics(copy.deepcopy(model), reference, batches, **space, beta=BETA)
    before, after = trl_dpo_step(model, reference, batches, **space, beta=BETA, lr=lr, optimizer=optimizer)
    assert before["loss"] == pytest.approx(fresh["loss"], abs=1e-6)
    assert after["loss"] < before["loss"]
