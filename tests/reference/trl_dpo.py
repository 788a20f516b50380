"""TRL's DPO numbers for our pair micro batches: the reference our DPO trainer is tested against.

Our pair micro batch is an SFT micro batch (megatron_ext/data/batching.py) whose rows hold whole
pairs: segments 2k+1 and 2k+2 of a row are one pair's chosen and rejected sequence, `images` holds
each pair's images once and `image_index` names the one each image token uses (tiled models: each
pair's tiles once, `image_index` the tiles of every image and video use, `media_layout` a row per
use). `trl_batch` turns micro batches into the padded batch TRL's collator would build;
`trl_dpo_metrics` and `trl_dpo_step` run a real `trl.DPOTrainer`'s own loss on it (CPU, fp32).
`per_pair_logps` is an independent computation of the answers' log-probs with the plain HF model.
`trl_examples` gives pairs as TRL's conversational vision rows, which TRL's own collator tokenizes
(`collated`: TRL's DPOTrainer building its batch itself, instead of `trl_batch`).
"""

from __future__ import annotations

import copy
import re
import tempfile
from dataclasses import dataclass

import torch

from megatron_ext.verify.hf_loop import IGNORE, HfSample, hf_samples, media_inputs, native_samples

# TRL's `_metrics["train"]` keys besides the loss that `trl_dpo_metrics` returns; `num_tokens`, a
# running total over the trainer's life, is left out.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")

# Any id but the image token's serves: the attention mask hides padding and right padding leaves
# the real tokens' positions as they are.
PAD = 0


@dataclass(frozen=True)
class NativeSpace:
    """A native-resolution model's media (Qwen2.5-VL, Qwen3-VL): besides its image token, its video token and
    the merge size that makes each image's grid its token count."""
    video_token_id: int
    merge_size: int


# Per media kind of a native-resolution pair batch: pixel rows, grids, the one each use shows.
_NATIVE_MEDIA = (("pixel_values", "image_grid_thw", "image_uses"), ("pixel_values_videos", "video_grid_thw", "video_uses"))


def _unshared(batch: dict) -> dict:
    """A native-resolution pair batch (`data.native_resolution_pairs`) with each image's (video's)
    pixel rows and grid repeated at every use, as transformers takes a row's media."""
    out = dict(batch)
    for pixels, grid, uses in _NATIVE_MEDIA:
        rows = batch[pixels].split(batch[grid].prod(-1).tolist())
        out[pixels] = torch.cat([rows[use] for use in batch[uses]]) if len(batch[uses]) else batch[pixels]
        out[grid] = batch[grid][batch[uses]]
    out["second_per_grid_ts"] = batch["second_per_grid_ts"][batch["video_uses"]]
    return out


def pair_samples(micro_batches: list[dict], image_token_index: int, img_seq_len: int,
                 tiled=None, native: NativeSpace | None = None) -> list[tuple[HfSample, HfSample]]:
    """(chosen, rejected) of every pair, in pair order, in HF's token space (`tiled`: as `hf_samples`;
    `native`: the pairs of a native-resolution model)."""
    pairs = []
    for batch in micro_batches:
        counts = batch["segment_ids"].max(dim=1).values
        if (counts % 2).any():
            raise ValueError(f"rows hold {counts.tolist()} sequences: a pair batch's rows hold whole pairs")
        samples = (native_samples(_unshared(batch), image_token_index, native.video_token_id, native.merge_size)
                   if native else hf_samples(batch, image_token_index, img_seq_len, tiled))
        pairs += zip(samples[0::2], samples[1::2])
    return pairs


def trl_batch(micro_batches: list[dict], image_token_index: int, img_seq_len: int, tiled=None,
              native: NativeSpace | None = None) -> dict:
    """The pairs of `micro_batches` as TRL's preference collator lays them out: rows [chosen_1..chosen_P,
    rejected_1..rejected_P], right padded; `completion_mask` marks the answer tokens; the media of
    every row in row order (each pair's twice: chosen, rejected) as the model's processor batches
    them (`hf_loop.media_inputs`: `pixel_values`; tiled models also `image_sizes`, OneVision
    `batch_num_images` and `pixel_values_videos`; native-resolution ones their grids)."""
    if image_token_index == PAD:
        raise ValueError(f"the image token {image_token_index} is the padding id")
    chosen, rejected = zip(*pair_samples(micro_batches, image_token_index, img_seq_len, tiled, native))
    rows = [*chosen, *rejected]
    shape = (len(rows), max(s.input_ids.shape[1] for s in rows))
    input_ids = torch.full(shape, PAD, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    completion_mask = torch.zeros(shape, dtype=torch.long)
    for row, s in enumerate(rows):
        n = s.input_ids.shape[1]
        input_ids[row, :n] = s.input_ids[0]
        attention_mask[row, :n] = 1
        completion_mask[row, :n] = s.labels[0] != IGNORE
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
            **media_inputs(rows)}


@torch.no_grad()
def per_pair_logps(model, micro_batches: list[dict], image_token_index: int, img_seq_len: int,
                   tiled=None) -> torch.Tensor:
    """[P, 2] float: the summed log-probs of each pair's chosen and rejected answer tokens, each
    sequence run alone through the plain HF model (logits, log-softmax; no TRL)."""
    out = []
    for pair in pair_samples(micro_batches, image_token_index, img_seq_len, tiled):
        row = []
        for s in pair:
            logits = model(**s.inputs(model.device)).logits[0, :-1].float()
            targets = s.labels[0, 1:].to(model.device)
            trained = targets != IGNORE
            logps = logits[trained].log_softmax(-1).gather(-1, targets[trained, None])
            row.append(logps.sum())
        out.append(torch.stack(row))
    return torch.stack(out).cpu()


def dpo_trainer(policy, reference, output_dir: str, *, beta: float, loss_type: str, label_smoothing: float,
                rpo_alpha: float | None, processor=None):
    """A `trl.DPOTrainer` on `policy` (CPU, fp32, no gradient checkpointing, no truncation).
    `reference` None: a PEFT policy's reference is the policy with its adapters off (see below; a
    plain model's, the checkpoint TRL loads again from `config._name_or_path`). RPO is TRL 1.16's
    `loss_type=["sigmoid", "sft"]`, `loss_weights=[1, rpo_alpha]`: its "sft" term is the mean NLL
    over the batch's chosen answer tokens, the old `rpo_alpha` term.

    Side effects of TRL's constructor: it seeds the global RNGs (`args.seed`), turns dropout off in
    both models and patches a fused LM head onto their forward (calls without `fused_lm_head=True`
    run the original). Its processor is the checkpoint's at `config._name_or_path`, as
    `hf.processors.load_processor` builds it (TRL's own AutoProcessor needs torchvision for OneVision's
    video processor), unless `processor` is given; trl_batch stands in for its collator, or TRL's own
    collator processes `trl_examples` with the processor."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from megatron_ext.hf.processors import load_processor

    losses, weights = [loss_type], None
    if rpo_alpha is not None:
        if loss_type != "sigmoid":
            raise ValueError(f"RPO adds its NLL term to the sigmoid loss, not to {loss_type!r}")
        losses, weights = ["sigmoid", "sft"], [1.0, rpo_alpha]
    args = DPOConfig(output_dir=output_dir, beta=beta, loss_type=losses, loss_weights=weights,
                     label_smoothing=label_smoothing, precompute_ref_log_probs=False, report_to=[], use_cpu=True,
                     bf16=False, gradient_checkpointing=False, max_length=None)
    # TRL wants a train dataset; an "images" column makes it a vision dataset, which TRL leaves
    # unprocessed (its collator, which we replace with trl_batch, would process it on the fly).
    dummy = Dataset.from_dict({"prompt": ["-"], "chosen": ["-"], "rejected": ["-"], "images": [[]]})
    processor = processor or load_processor(policy.config._name_or_path, "--hf-dir")
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dummy, processing_class=processor)
    if reference is None and "ref" in getattr(policy, "peft_config", {}):
        # Given a PeftModel, TRL copies its adapter into a frozen "ref" adapter, the reference; ours is
        # the base model, TRL's rule for an adapter it adds itself (`peft_config`): adapters off.
        policy.delete_adapter("ref")
    # TRL files the metrics under "train" only for a model in training mode.
    trainer.model.train()
    return trainer


def trl_examples(pairs) -> list[dict]:
    """`shard_format.PreferenceSample`s as TRL's conversational vision rows: the prompt's text without
    its `<image>` markers and a newline after each (TRL puts the images before the first user turn's
    text, as the pairs have them), the answers as assistant messages, the images."""
    def text(message):
        return {"role": message["role"], "content": re.sub("<image>\n?", "", message["content"])}

    return [{"prompt": [text(m) for m in p.prompt], "chosen": [{"role": "assistant", "content": p.chosen}],
             "rejected": [{"role": "assistant", "content": p.rejected}], "images": list(p.images)} for p in pairs]


def _batch(trainer, micro_batches, examples, image_token_index, img_seq_len, tiled) -> dict:
    """TRL's own collator's batch of `examples` (TRL rows) when given, else `trl_batch(micro_batches)`."""
    if examples is not None:
        return trainer.data_collator(copy.deepcopy(examples))
    return trl_batch(micro_batches, image_token_index, img_seq_len, tiled)


def _metrics(trainer, loss: torch.Tensor) -> dict:
    logged = trainer._metrics["train"]
    out = {"loss": loss.item(), **{key: logged[key][-1] for key in METRICS}}
    logged.clear()
    return out


def trl_dpo_metrics(policy, reference, micro_batches: list[dict], *, image_token_index: int, img_seq_len: int,
                    tiled=None, examples: list[dict] | None = None, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    rpo_alpha: float | None = None, processor=None) -> dict:
    """TRL's DPO loss and metrics on all pairs of `micro_batches` as one batch: {"loss", *METRICS},
    floats, as `DPOTrainer._compute_loss` logs them (means over the pairs). `tiled`: as `hf_samples`;
    `examples`: TRL rows (`trl_examples`) that TRL's collator tokenizes itself, instead of `micro_batches`;
    `processor`: as `dpo_trainer`'s."""
    with tempfile.TemporaryDirectory() as output_dir, torch.no_grad():
        trainer = dpo_trainer(policy, reference, output_dir, beta=beta, loss_type=loss_type,
                              label_smoothing=label_smoothing, rpo_alpha=rpo_alpha, processor=processor)
        batch = _batch(trainer, micro_batches, examples, image_token_index, img_seq_len, tiled)
        return _metrics(trainer, trainer.compute_loss(trainer.model, batch))


def trl_dpo_step(policy, reference, micro_batches: list[dict], *, image_token_index: int, img_seq_len: int,
                 lr: float, tiled=None, examples: list[dict] | None = None, steps: int = 1, optimizer: str = "sgd",
                 beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 rpo_alpha: float | None = None, processor=None) -> list[dict]:
    """[metrics before each of `steps` optimizer steps of TRL's loss on `micro_batches`, ..., metrics
    after the last], each as `trl_dpo_metrics` returns them, on the same batch (one step: before,
    after). The step: torch.optim.SGD (no momentum) or torch.optim.AdamW (default betas and eps, no
    weight decay) at `lr` over the policy's parameters that require grad, no clipping, no schedule.
    It updates `policy` in place. `examples`, `processor`: as `trl_dpo_metrics`."""
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = dpo_trainer(policy, reference, output_dir, beta=beta, loss_type=loss_type,
                              label_smoothing=label_smoothing, rpo_alpha=rpo_alpha, processor=processor)
        batch = _batch(trainer, micro_batches, examples, image_token_index, img_seq_len, tiled)
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        if optimizer == "sgd":
            step = torch.optim.SGD(trained, lr=lr)
        elif optimizer == "adamw":
            step = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
        else:
            raise ValueError(f"optimizer {optimizer!r}: sgd or adamw")
        metrics = []
        for _ in range(steps):
            step.zero_grad()
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            metrics.append(_metrics(trainer, loss))
            step.step()
        with torch.no_grad():
            return [*metrics, _metrics(trainer, trainer.compute_loss(trainer.model, batch))]
