"""The parity check's reference: a plain PyTorch loop on transformers' LlavaForConditionalGeneration,
trained as transformers' Trainer trains it, on the global batches our trainer recorded.

What it copies from the Trainer: the loss is the model's own (`labels`, with `num_items_in_batch` =
the trained tokens of the whole global batch, so every token weighs the same); AdamW
(torch.optim.AdamW) with weight decay on the parameters `Trainer.get_decay_parameter_names` names;
`clip_grad_norm_` over every trained parameter; the schedule from `transformers.get_scheduler`.
Each sample runs alone (no padding, no packing), as a micro batch of one. In bf16 (on a GPU) the
weights and AdamW stay fp32 and the forward runs under `torch.autocast`, as the Trainer's `bf16=True`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_ext.errors import UserError

# transformers' loss ignores these labels.
IGNORE = -100


@dataclass
class HfSample:
    input_ids: torch.Tensor  # [1, L]: HF's tokens, each image token repeated once per image feature
    pixel_values: torch.Tensor | None  # [n, 3, H, W]
    labels: torch.Tensor  # [1, L]: the token at p where position p - 1 is trained, else IGNORE

    @property
    def trained_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def hf_samples(micro_batch: dict, image_token_index: int, img_seq_len: int) -> list[HfSample]:
    """Every sample of one of our micro batches (rows, packed samples in order), in HF's token space.
    Our rows hold one image token per image, and position t is trained where loss_mask[t] (its label
    being token t + 1); HF's hold `img_seq_len` tokens per image and labels that transformers shifts.
    A DPO pair batch holds each pair's images once: its `image_index` names the image each image token uses."""
    images = micro_batch["images"]
    if "image_index" in micro_batch:
        images = images[micro_batch["image_index"]]
    images = iter(images)
    out = []
    for ids, labels, mask, segments in zip(micro_batch["input_ids"], micro_batch["labels"], micro_batch["loss_mask"],
                                           micro_batch["segment_ids"]):
        for segment in range(1, int(segments.max()) + 1):
            where = segments == segment
            out.append(_expand(ids[where], labels[where], mask[where], images, image_token_index, img_seq_len))
    return out


def _expand(ids, labels, mask, images, image_token_index: int, img_seq_len: int) -> HfSample:
    tokens, trained, pixels = [], [], []
    for t, token in enumerate(ids.tolist()):
        if token == image_token_index:
            pixels.append(next(images))
            tokens += [token] * img_seq_len
            trained += [False] * img_seq_len
            continue
        if mask[t] and labels[t] != ids[t + 1]:
            raise ValueError(f"label {int(labels[t])} at {t} is not the next token {int(ids[t + 1])}")
        tokens.append(token)
        trained.append(bool(mask[t]))
    hf_labels = torch.tensor([IGNORE] + [tok if prev else IGNORE for tok, prev in zip(tokens[1:], trained)])
    return HfSample(torch.tensor([tokens]), torch.stack(pixels) if pixels else None, hf_labels[None])


def frozen(name: str, stage: int, unfreeze_vit: bool) -> bool:
    """Our stages in HF names: the vision tower trains only with --unfreeze-vit, the language model
    (and lm_head) only in stage 2, the projector (and a tiled LLaVA's newline) always."""
    if "vision_tower." in name:
        return not unfreeze_vit
    if "multi_modal_projector." in name or name.endswith("image_newline"):
        return False
    return stage == 1


def decayed_names(model) -> set[str]:
    """The parameters transformers' Trainer applies weight decay to (it excludes biases and norms)."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


def hf_scheduler(optimizer, style: str, warmup: int, steps: int, lr: float, min_lr: float):
    """transformers' schedule equal to megatron-core's `style` with this warm-up and min-lr."""
    from transformers import get_scheduler

    if style == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, warmup, steps, {"min_lr": min_lr})
    if style == "constant":
        return get_scheduler("constant_with_warmup", optimizer, warmup, steps)
    if min_lr:
        raise UserError(f"--lr-decay-style linear with --min-lr {min_lr}: transformers' linear schedule decays to 0; "
                        "check parity with --min-lr 0")
    return get_scheduler("linear", optimizer, warmup, steps)


@dataclass(frozen=True)
class Hyper:
    stage: int
    unfreeze_vit: bool
    lr: float
    min_lr: float
    warmup: int  # steps, as our trainer computed them
    steps: int  # the schedule's length (our --train-iters)
    style: str
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip_grad: float


def global_normalizer(batches: list[list[HfSample]]) -> list[int]:
    """What each micro batch's summed token losses are divided by: the global batch's trained tokens."""
    total = sum(s.trained_tokens for batch in batches for s in batch)
    return [total] * len(batches)


class HfLoop:
    def __init__(self, hf_dir: str, hyper: Hyper, img_seq_len: int, device: str = "cpu", dtype: str = "float32"):
        """`img_seq_len`: image tokens per image in HF's input (our `LlavaArch.img_seq_len`); `dtype`: the
        compute dtype (float32, or bfloat16 through autocast)."""
        from transformers import LlavaForConditionalGeneration

        self.device = torch.device(device)
        self.autocast = torch.autocast(self.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
        self.model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).to(self.device)
        self.model.train()
        self.img_seq_len = img_seq_len
        self.config = self.model.config
        for name, p in self.model.named_parameters():
            p.requires_grad_(not frozen(name, hyper.stage, hyper.unfreeze_vit))
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        decay = decayed_names(self.model)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": hyper.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps)
        self.scheduler = hf_scheduler(self.optimizer, hyper.style, hyper.warmup, hyper.steps, hyper.lr, hyper.min_lr)
        self.clip_grad = hyper.clip_grad

    def step(self, micro_batches: list[dict]) -> tuple[float, float]:
        """One optimizer step on our recorded micro batches: (loss, gradient norm before clipping)."""
        batches = [hf_samples(b, self.config.image_token_index, self.img_seq_len) for b in micro_batches]
        self.optimizer.zero_grad()
        loss = 0.0
        for batch, normalizer in zip(batches, global_normalizer(batches)):
            for s in batch:
                pixels = None if s.pixel_values is None else s.pixel_values.to(self.device)
                with self.autocast:
                    out = self.model(input_ids=s.input_ids.to(self.device), pixel_values=pixels,
                                     labels=s.labels.to(self.device),
                                     num_items_in_batch=torch.tensor(normalizer, device=self.device))
                out.loss.backward()
                loss += out.loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.clip_grad if self.clip_grad else math.inf)
        self.optimizer.step()
        self.scheduler.step()
        return loss, float(norm)
