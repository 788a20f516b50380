"""The parity check's reference: a plain PyTorch loop on transformers' model of the checkpoint
(LlavaForConditionalGeneration and its tiled kin, the Qwen-VL models), trained as
transformers' Trainer trains it, on the global batches our trainer recorded.

What it copies from the Trainer: the loss is the model's own (`labels`, with `num_items_in_batch` =
the trained tokens of the whole global batch, so every token weighs the same); AdamW
(torch.optim.AdamW), or torch.optim.SGD, with weight decay on the parameters
`Trainer.get_decay_parameter_names` names; `clip_grad_norm_` over every trained parameter; the
schedule from `transformers.get_scheduler`. Each sample runs alone (no padding, no packing), as a
micro batch of one. A native-resolution sample (Qwen-VL) goes with its token types and grids, and
transformers computes its mRoPE positions itself (`get_rope_index`), not from our batch's. In bf16 (on a GPU) the weights and the optimizer stay fp32 and the forward runs
under `torch.autocast`, as the Trainer's `bf16=True`. With `Adapters` the model is a PEFT LoRA model
that starts from our run's initial adapters. The first step's gradients are kept (`first_grads`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_ext.errors import UserError
from megatron_ext.model import tiling

if TYPE_CHECKING:
    from megatron_ext.data.anyres import FeatureLayout

# transformers' loss ignores these labels.
IGNORE = -100


@dataclass
class HfSample:
    """One sample as transformers' processor gives it, ready for the model's forward (`inputs`)."""

    input_ids: torch.Tensor  # [1, L]: HF's tokens, each image token repeated once per image feature
    labels: torch.Tensor  # [1, L]: the token at p where position p - 1 is trained, else IGNORE
    # LLaVA-1.5: [n, 3, H, W]; tiled: [n, most tiles, 3, H, W], each image's tiles then zero tiles
    pixel_values: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None  # tiled: long [n, 2], each image's (height, width)
    batch_num_images: torch.Tensor | None = None  # OneVision: long [1], the images (one tile each when several)
    pixel_values_videos: torch.Tensor | None = None  # OneVision: [videos, frames, 3, H, W]; Qwen2.5-VL: rows
    image_grid_thw: torch.Tensor | None = None  # Qwen2.5-VL: long [n, 3]; `pixel_values` are the images' rows
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # Qwen2.5-VL: float [videos], what their positions take
    mm_token_type_ids: torch.Tensor | None = None  # Qwen2.5-VL: int [1, L], 0 text, 1 image, 2 video

    @property
    def trained_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def inputs(self, device) -> dict:
        """The model's forward kwargs: tokens, labels and whatever media the sample has."""
        types = {} if self.mm_token_type_ids is None else {"mm_token_type_ids": self.mm_token_type_ids}
        return {key: value.to(device) for key, value in
                {"input_ids": self.input_ids, "labels": self.labels, **types, **media_inputs([self])}.items()}


MEDIA_KEYS = ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
              "second_per_grid_ts")


def media_inputs(samples: list[HfSample]) -> dict:
    """The media of `samples` as one batch of transformers' processor holds them: every key some
    sample has, concatenated in sample order; tiled images' tiles padded with zero tiles to the
    most any image has, as the processor pads them."""
    out = {}
    for key in MEDIA_KEYS:
        parts = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if key == "pixel_values" and parts and parts[0].dim() == 5:
            parts = _padded(parts)
        if parts:
            out[key] = torch.cat(parts)
    return out


def _padded(images: list[torch.Tensor]) -> list[torch.Tensor]:
    """[n, tiles, 3, H, W] parts padded to one tile count."""
    most = max(p.shape[1] for p in images)
    return [torch.cat([p, p.new_zeros((p.shape[0], most - p.shape[1], *p.shape[2:]))], 1) for p in images]


def hf_samples(micro_batch: dict, image_token_index: int, img_seq_len: int,
               tiled: FeatureLayout | None = None) -> list[HfSample]:
    """Every sample of one of our micro batches (rows, packed samples in order), in HF's token space.
    Our rows hold one image token per image, and position t is trained where loss_mask[t] (its label
    being token t + 1); HF's hold `img_seq_len` tokens per image and labels that transformers shifts.
    A DPO pair batch holds each pair's images once: its `image_index` names the image each image token uses.

    Tiled models (`tiled`: the HF processor's `anyres.FeatureLayout`; `img_seq_len` 1): our rows hold
    one token per feature already, as HF's; `images` holds the tiles of every image and video (pair
    batches: through `image_index`) and `media_layout` their rows, in token order; a sample takes
    the media whose features make up its image and video tokens."""
    images = micro_batch["images"]
    if "image_index" in micro_batch:
        images = images[micro_batch["image_index"]]
    if tiled is None:
        media = _Images(images, image_token_index)
    elif img_seq_len != 1:
        raise ValueError(f"a tiled model's image tokens are one position each, not img_seq_len {img_seq_len}")
    else:
        media = _TiledMedia(images, micro_batch["media_layout"], image_token_index, tiled)
    out = []
    for ids, labels, mask, segments in zip(micro_batch["input_ids"], micro_batch["labels"], micro_batch["loss_mask"],
                                           micro_batch["segment_ids"]):
        for segment in range(1, int(segments.max()) + 1):
            where = segments == segment
            tokens, hf_labels = _expand(ids[where], labels[where], mask[where], image_token_index, img_seq_len)
            out.append(HfSample(tokens, hf_labels, **media.take(ids[where])))
    return out


class _Images:
    """LLaVA-1.5's images, one per image token."""

    def __init__(self, images: torch.Tensor, image_token_index: int):
        self.images, self.token, self.next = images, image_token_index, 0

    def take(self, ids: torch.Tensor) -> dict:
        count = int((ids == self.token).sum())
        self.next += count
        if self.next > len(self.images):
            raise ValueError(f"the micro batch has {len(self.images)} images for more image tokens")
        return {"pixel_values": self.images[self.next - count:self.next]} if count else {}


class _TiledMedia:
    """A tiled micro batch's images and videos (`model.tiling.Media` rows and their tiles), in token order."""

    def __init__(self, tiles: torch.Tensor, layout: torch.Tensor, image_token_index: int, features: FeatureLayout):
        self.media = [tiling.Media(*row) for row in layout.tolist()]
        self.tiles = torch.split(tiles, [m.tiles for m in self.media])
        self.tokens = torch.tensor([t for t in (image_token_index, features.tiling.video_token_index) if t is not None])
        self.features = features
        self.next = 0

    def take(self, ids: torch.Tensor) -> dict:
        """The inputs of the media whose features are the sample's image and video tokens."""
        wanted = int(torch.isin(ids, self.tokens).sum())
        images, sizes, videos = [], [], []
        while wanted > 0:
            if self.next == len(self.media):
                raise ValueError(f"the media layout ends {wanted} image and video tokens short")
            media, tiles = self.media[self.next], self.tiles[self.next]
            self.next += 1
            f = self.features
            wanted -= tiling.feature_count(media, f.tiling, f.tile, f.side)
            if media.kind == tiling.VIDEO:
                videos.append(tiles)
            else:
                images.append(tiles[None])
                sizes.append((media.height, media.width))
        if wanted:
            raise ValueError("a sample's image and video tokens end inside a media's features")
        out = {}
        if images:
            out.update(pixel_values=torch.cat(_padded(images)), image_sizes=torch.tensor(sizes))
            if self.features.one_tile_when_several:
                out["batch_num_images"] = torch.tensor([len(images)])
        if videos:
            if len({len(v) for v in videos}) > 1:
                raise ValueError(f"videos of {sorted({len(v) for v in videos})} frames: transformers stacks a "
                                 "sample's videos, which needs one frame count")
            out["pixel_values_videos"] = torch.stack(videos)
        return out


def native_samples(micro_batch: dict, image_token_id: int, video_token_id: int, merge_size: int) -> list[HfSample]:
    """Every sample of a native-resolution micro batch (rows, packed samples in order; their image and
    video tokens expanded as transformers' processor expands them) with its own pixel rows, grids and
    token types."""
    from megatron_ext.data.native_resolution import token_types

    # Qwen3-VL's videos carry no seconds per frame pair (their times are text).
    seconds = micro_batch["second_per_grid_ts"]
    seconds = seconds if len(seconds) == len(micro_batch["video_grid_thw"]) > 0 else None
    media = [(token, pixels, grids, _GridMedia(micro_batch[pixels], micro_batch[grids], merge_size, held_seconds))
             for token, pixels, grids, held_seconds in ((image_token_id, "pixel_values", "image_grid_thw", None),
                                                         (video_token_id, "pixel_values_videos", "video_grid_thw", seconds))]
    out = []
    for ids, labels, mask, segments in zip(micro_batch["input_ids"], micro_batch["labels"], micro_batch["loss_mask"],
                                           micro_batch["segment_ids"]):
        for segment in range(1, int(segments.max()) + 1):
            where = segments == segment
            tokens, hf_labels = _expand(ids[where], labels[where], mask[where], image_token_id, 1)
            parts = {}
            for token, pixels, grids, held in media:
                if taken := held.take(int((ids[where] == token).sum())):
                    parts[pixels], parts[grids], seconds = taken
                    if seconds is not None:
                        parts["second_per_grid_ts"] = seconds
            types = torch.from_numpy(token_types(tokens[0], image_token_id, video_token_id))[None].int()
            out.append(HfSample(tokens, hf_labels, mm_token_type_ids=types, **parts))
    return out


class _GridMedia:
    """A native-resolution micro batch's images (or videos, with their seconds per frame pair): their
    pixel rows and grids, in token order."""

    def __init__(self, rows: torch.Tensor, grids: torch.Tensor, merge_size: int, seconds: torch.Tensor | None = None):
        self.rows, self.grids, self.merge, self.seconds = rows, grids, merge_size, seconds
        self.next_grid = self.next_row = 0

    def take(self, tokens: int) -> tuple | None:
        """(pixel rows, grids, seconds or None) of the media whose merged patches are the next `tokens` tokens."""
        first_grid, first_row = self.next_grid, self.next_row
        while tokens > 0:
            if self.next_grid == len(self.grids):
                raise ValueError(f"the micro batch's grids end {tokens} media tokens short")
            patches = int(self.grids[self.next_grid].prod())
            tokens -= patches // self.merge**2
            self.next_grid, self.next_row = self.next_grid + 1, self.next_row + patches
        if tokens:
            raise ValueError("a sample's media tokens end inside a grid's merged patches")
        if self.next_grid == first_grid:
            return None
        seconds = None if self.seconds is None else self.seconds[first_grid:self.next_grid]
        return self.rows[first_row:self.next_row], self.grids[first_grid:self.next_grid], seconds


def _expand(ids, labels, mask, image_token_index: int, img_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(HF's tokens [1, L], HF's labels [1, L]) of one sample."""
    tokens, trained = [], []
    for t, token in enumerate(ids.tolist()):
        if token == image_token_index:
            tokens += [token] * img_seq_len
            trained += [False] * img_seq_len
            continue
        if mask[t] and labels[t] != ids[t + 1]:
            raise ValueError(f"label {int(labels[t])} at {t} is not the next token {int(ids[t + 1])}")
        tokens.append(token)
        trained.append(bool(mask[t]))
    hf_labels = torch.tensor([IGNORE] + [tok if prev else IGNORE for tok, prev in zip(tokens[1:], trained)])
    return torch.tensor([tokens]), hf_labels[None]


# transformers' names of the parts our stages train apart: LLaVA's, then Qwen-VL's, whose projector
# (the patch merger; Qwen3-VL's DeepStack mergers too) lies inside its tower, so projectors are looked for first.
PROJECTORS = ("multi_modal_projector.", "visual.merger.", "visual.deepstack_merger_list.")
TOWERS = ("vision_tower.", "visual.")


def frozen(name: str, stage: int, unfreeze_vit: bool) -> bool:
    """Our stages in HF names: the vision tower trains only with --unfreeze-vit, the language model
    (and lm_head) only in stage 2, the projector (and a tiled LLaVA's newline) always."""
    if any(part in name for part in PROJECTORS) or name.endswith("image_newline"):
        return False
    if any(part in name for part in TOWERS):
        return not unfreeze_vit
    return stage == 1


def decayed_names(model) -> set[str]:
    """The parameters transformers' Trainer applies weight decay to (it excludes biases and norms), but
    none of one dimension: the Trainer knows a norm by its class or name, and Qwen2.5-VL's merger norm
    (`visual.merger.ln_q`, a Qwen2RMSNorm) has neither, while megatron-core leaves every 1-D tensor undecayed."""
    from transformers import Trainer

    decayed = set(Trainer.get_decay_parameter_names(None, model))
    return {name for name, param in model.named_parameters() if name in decayed and param.dim() > 1}


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
class TrainingSettings:
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
    optimizer: str = "adam"  # or "sgd"
    momentum: float = 0.0  # SGD's


def hf_optimizer(groups: list[dict], hyper: TrainingSettings) -> torch.optim.Optimizer:
    """megatron-core's optimizer in torch's class: AdamW (decoupled weight decay), or SGD, whose weight
    decay is added to the gradient before the momentum, as in megatron-core's (torch's or a fused
    twin with the same rule)."""
    if hyper.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=hyper.lr, momentum=hyper.momentum)
    return torch.optim.AdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps)


@dataclass(frozen=True)
class Adapters:
    """A PEFT LoRA adapter directory (our run's initial adapters, exported) for the model to train.

    `tied`: groups of transformers module names whose lora_A is to be one parameter. Our adapters wrap
    megatron-core's fused layers, so q, k and v (gate and up) share one A, trained on the sum of their
    gradients; PEFT gives each module its own. Tied, the PEFT model trains what ours trains."""

    dir: Path
    tied: tuple[tuple[str, ...], ...] = ()


def require_peft() -> None:
    """--lora-rank's other side is a PEFT model; peft comes with the parity extra, not the base install."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError("--lora-rank checks our adapters against a PEFT model and peft is not installed: "
                        "pip install 'megatron-ext[parity]'") from None


def with_adapters(model, adapters: Adapters):
    """transformers' `model` wrapped by peft with the adapters' rank, alpha and target modules (PEFT's
    scaling alpha / r, no rsLoRA, no dropout: the parity check refuses --lora-dropout, whose masks
    cannot match), their lora_A tied as `adapters.tied` says, loaded with the adapters' weights. The
    base is frozen; the projector trains when the adapter saves it (--lora-train-projector)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from megatron_ext.convert.lora_export import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

    config = json.loads((adapters.dir / ADAPTER_CONFIG_FILE).read_text())
    model = get_peft_model(model, LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], lora_dropout=0.0,
                                             target_modules=config["target_modules"], bias="none", use_rslora=False))
    for group in adapters.tied:
        shared = model.base_model.model.get_submodule(group[0]).lora_A["default"].weight
        for name in group[1:]:
            model.base_model.model.get_submodule(name).lora_A["default"].weight = shared
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, tensor in load_file(adapters.dir / ADAPTER_WEIGHTS_FILE).items():
            name = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
            params[name].copy_(tensor)
    for module in config.get("modules_to_save") or ():
        model.base_model.model.get_submodule(module).requires_grad_(True)
    return model


def global_normalizer(batches: list[list[HfSample]]) -> list[int]:
    """What each micro batch's summed token losses are divided by: the global batch's trained tokens."""
    total = sum(s.trained_tokens for batch in batches for s in batch)
    return [total] * len(batches)


class HfLoop:
    def __init__(self, hf_dir: str, hyper: TrainingSettings, img_seq_len: int, device: str = "cpu", dtype: str = "float32",
                 adapters: Adapters | None = None):
        """`img_seq_len`: image tokens per image in HF's input (our `LlavaArch.img_seq_len`); `dtype`: the
        compute dtype (float32, or bfloat16 through autocast). The model is the checkpoint's own class
        (LLaVA, LLaVA-NeXT, OneVision, Qwen2.5-VL); a tiled model's media are laid out as its processor's. With
        `adapters`, a PEFT model training those (`with_adapters`) instead of the stage's parts."""
        from megatron_ext import families, hf_loading
        from megatron_ext.data.anyres import FeatureLayout
        from megatron_ext.hf.processors import load_processor

        kind = families.model_kind(hf_loading.load_config(hf_dir, "--hf-dir"))
        self.device = torch.device(device)
        self.autocast = torch.autocast(self.device.type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
        model = families.load_model(hf_dir, "--hf-dir", dtype=torch.float32)
        self.img_seq_len = img_seq_len
        self.tiled = FeatureLayout.of(load_processor(hf_dir, "--hf-dir", kind)) if kind.tiled else None
        self.config = model.config
        if adapters is None:
            for name, p in model.named_parameters():
                p.requires_grad_(not frozen(name, hyper.stage, hyper.unfreeze_vit))
        else:
            model = with_adapters(model, adapters)
        self.model = model.to(self.device)
        self.model.train()
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        # LoRA's A and B are weights of linear layers: decayed here as by megatron-core (2-D).
        decay = decayed_names(self.model)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": hyper.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        self.optimizer = hf_optimizer(groups, hyper)
        self.scheduler = hf_scheduler(self.optimizer, hyper.style, hyper.warmup, hyper.steps, hyper.lr, hyper.min_lr)
        self.clip_grad = hyper.clip_grad
        self.first_grads: dict[str, torch.Tensor] | None = None  # by parameter name, before clipping

    def step(self, micro_batches: list[dict]) -> tuple[float, float]:
        """One optimizer step on our recorded micro batches: (loss, gradient norm before clipping)."""
        batches = [self._samples(b) for b in micro_batches]
        self.optimizer.zero_grad()
        loss = 0.0
        for batch, normalizer in zip(batches, global_normalizer(batches)):
            for s in batch:
                with self.autocast:
                    out = self.model(**s.inputs(self.device),
                                     num_items_in_batch=torch.tensor(normalizer, device=self.device))
                out.loss.backward()
                loss += out.loss.item()
        if self.first_grads is None:
            self.first_grads = {n: p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu")
                                for n, p in self.model.named_parameters() if p.requires_grad}
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.clip_grad if self.clip_grad else math.inf)
        self.optimizer.step()
        self.scheduler.step()
        return loss, float(norm)

    def _samples(self, micro_batch: dict) -> list[HfSample]:
        c = self.config
        if "image_grid_thw" in micro_batch:  # a native-resolution batch
            return native_samples(micro_batch, c.image_token_id, c.video_token_id, c.vision_config.spatial_merge_size)
        return hf_samples(micro_batch, c.image_token_id, self.img_seq_len, tiled=self.tiled)
