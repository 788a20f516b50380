"""Run HF LLaVA and the Megatron model on the same processed inputs and compare their logits.

The pieces are reusable by generation/evaluation code:
- `process_inputs`: images + prompt -> HF processor output (chat template when the tokenizer has one);
- `collapse_image_tokens`: HF's processor expands each `<image>` into one token per image
  embedding, megatron-core's LLaVAModel expects one token per image and expands it itself
  (tiled models keep HF's tokens: each is one position);
- `model_input_ids`: HF-style ids as the Megatron model takes them (collapsed or not);
- `megatron_media`: the images of an HF processor batch as the Megatron model takes them (for
  tiled models each image's tiles and the media layout);
- `megatron_logits`: full-vocabulary logits of a TP/PP-split model, gathered over TP and sent
  from the last pipeline stage to every stage;
- `logit_stats`: max / mean |dlogit| and whether the next-token argmax agrees everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.model.sequence_alignment import combined_length

DEFAULT_PROMPT = "Describe this image."


def synthetic_image(seed: int = 0, size: tuple[int, int] = (70, 60)):
    """A fixed random-noise RGB image, for comparisons that need no image file."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).rand(size[1], size[0], 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def process_inputs(processor, images: list, prompt: str = DEFAULT_PROMPT):
    """HF processor output for one user turn about `images` (each placed before the text; generation
    prompt appended)."""
    if getattr(processor, "chat_template", None):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    else:
        text = f"{processor.image_token}\n" * len(images) + prompt
    return processor(images=images, text=text, return_tensors="pt")


def collapse_image_tokens(input_ids: torch.Tensor, image_token_index: int) -> torch.Tensor:
    """[B, S] ids with runs of image tokens -> each run one token (every row must collapse to one length)."""
    image = input_ids == image_token_index
    keep = torch.ones_like(image)
    keep[:, 1:] = ~(image[:, 1:] & image[:, :-1])
    rows = [ids[k] for ids, k in zip(input_ids, keep)]
    if len({len(row) for row in rows}) != 1:
        raise ValueError("rows of the batch collapse to different lengths; pad them after collapsing instead")
    return torch.stack(rows)


def model_input_ids(input_ids: torch.Tensor, image_token_index: int, img_seq_len: int) -> torch.Tensor:
    """HF-style `input_ids` (every image expanded) as the Megatron model takes them: as they are
    when each image token is one position (tiled models), else each image's run collapsed."""
    return input_ids if img_seq_len == 1 else collapse_image_tokens(input_ids, image_token_index)


def megatron_media(arch, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(images, media layout) of an HF processor batch for the Megatron model: LLaVA-1.5's
    pixel_values and no layout, or a tiled model's tiles (an image's grid, one tile of an image of
    a OneVision multi-image sample, a video's frames) and their layout, both in the order the media's
    tokens come in `batch["input_ids"]`."""
    from megatron_ext.model.tiling import IMAGE, VIDEO, Media, feature_count, grid_shape, layout_tensor

    tile = arch.vision.image_size
    pixels = batch.get("pixel_values")
    if arch.tiling is None:
        return pixels if pixels is not None else torch.empty(0, 3, tile, tile), None
    side = arch.vision.patches_per_side
    found = []  # (first token position, media, its tiles)
    ids = batch["input_ids"].flatten()

    def place(token: int, media: list[Media], tiles: list[torch.Tensor]) -> None:
        positions = torch.nonzero(ids == token).flatten().tolist()
        offset = 0
        for m, t in zip(media, tiles):
            found.append((positions[offset], m, t))
            offset += feature_count(m, arch.tiling, tile, side)

    if pixels is not None:
        sizes = batch["image_sizes"].tolist()
        # The processor's multi-image samples (OneVision's batch_num_images) give one tile per image.
        per_sample = batch.get("batch_num_images")
        alone = [n == 1 for n in per_sample.tolist() for _ in range(n)] if per_sample is not None else [True] * len(sizes)
        media = [Media(IMAGE, math.prod(grid_shape(h, w, arch.tiling, tile)) + 1 if one else 1, h, w)
                 for (h, w), one in zip(sizes, alone)]
        place(arch.image_token_index, media, [p[:m.tiles] for p, m in zip(pixels, media)])
    videos = batch.get("pixel_values_videos")
    if videos is not None:
        place(arch.tiling.video_token_index, [Media(VIDEO, len(v)) for v in videos], list(videos))
    found.sort(key=lambda entry: entry[0])
    images = torch.cat([t for _, _, t in found]) if found else torch.empty(0, 3, tile, tile)
    return images, layout_tensor([m for _, m, _ in found])


def megatron_logits(model, images: torch.Tensor, input_ids: torch.Tensor, img_seq_len: int, vocab_size: int,
                    media_layout: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, vocab_size] (float32, on the host of every rank) for HF-style `input_ids` [B, S]
    whose image tokens are already expanded (`media_layout`: a tiled model's, `megatron_media`).
    Collective over the model-parallel group (NCCL on a GPU: every tensor in it lives where the model
    does); the model must be built with `parallel_output=False`, and is left in eval mode."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    image_token_index = model.image_token_index
    device = next(model.parameters()).device
    ids = model_input_ids(input_ids, image_token_index, img_seq_len)
    num_images = int((ids[0] == image_token_index).sum())
    seq_length = combined_length(ids.shape[1], num_images, img_seq_len)
    max_length = model.language_model.max_sequence_length
    if seq_length > max_length:
        raise ValueError(f"{seq_length} tokens (images expanded) exceed the model's seq_length {max_length}")
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    # Under PP, LLaVAModel pads every sequence to the model's seq_length (fixed p2p shapes).
    sent_length = max_length if pipelined else seq_length

    layout = {} if media_layout is None else {"media_layout": media_layout}

    def forward_step(data_iterator, module):
        output, _ = module(images=images.to(device), input_ids=next(data_iterator).to(device), position_ids=None,
                           attention_mask=None, **layout)
        return output, None

    model.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=sent_length, micro_batch_size=ids.shape[0], forward_only=True)
    logits = outputs[0][:, :seq_length, :vocab_size] if parallel_state.is_pipeline_last_stage() else None
    return _on_every_stage(logits, (ids.shape[0], seq_length, vocab_size), device)


def _on_every_stage(logits: torch.Tensor | None, shape: tuple, device) -> torch.Tensor:
    """The last pipeline stage's `logits` (None elsewhere) as float32 on the host of every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    logits = logits.float().contiguous() if logits is not None else torch.empty(shape, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(logits, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return logits.cpu()


def mrope_forward(model, inputs: dict, inference_context=None) -> torch.Tensor | None:
    """A native-resolution model's (`model/mrope_vlm.py`) logits [1, S, padded vocab] on the last
    pipeline stage, None elsewhere, for `NativeResolutionTaskEncoder.encode_prompt`'s inputs on the
    model's device (its own positions; transformers' token types unused), gathered over TP.
    `inference_context`: a KV cache holding the positions before `input_ids` (`position_ids` then
    cover those too). Collective over the model-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ids = inputs["input_ids"]
    media = {name: inputs[name] for name in _MROPE_MEDIA if name in inputs}

    def forward_step(data_iterator, module):
        return module(next(data_iterator), inputs["position_ids"], runtime_gather_output=True,
                      inference_context=inference_context, **media), None

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
        seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


# What `MRopeVisionLanguageModel.forward` takes of a prompt's media.
_MROPE_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


@dataclass(frozen=True)
class LogitStats:
    max_abs: float
    mean_abs: float
    argmax_agree: bool
    positions: int
    disagreeing: tuple[int, ...]  # positions whose argmax differs

    def lines(self) -> list[str]:
        agree = "yes" if self.argmax_agree else f"NO (positions {list(self.disagreeing)[:20]})"
        return [f"max |dlogit|:  {self.max_abs:.3e}", f"mean |dlogit|: {self.mean_abs:.3e}",
                f"next-token argmax agrees at all {self.positions} positions: {agree}"]


def logit_stats(reference: torch.Tensor, logits: torch.Tensor) -> LogitStats:
    if reference.shape != logits.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot be compared with {tuple(reference.shape)}")
    diff = (reference.float() - logits.float()).abs()
    same = reference.argmax(-1) == logits.argmax(-1)
    return LogitStats(max_abs=diff.max().item(), mean_abs=diff.mean().item(), argmax_agree=bool(same.all()),
                      positions=same.numel(), disagreeing=tuple(torch.nonzero(~same.flatten()).flatten().tolist()))


def hf_logits(hf_dir: Path, batch) -> torch.Tensor:
    """The HF LLaVA's (of whichever class its config names) logits in float32."""
    from megatron_ext import families

    model = families.load_model(hf_dir, "--hf-dir", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).logits.float()


def _megatron_logits_rank(snapshot_dir: Path, tp: int, pp: int, batch: dict) -> torch.Tensor:
    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.lora.checkpoint import load_for_inference
    from megatron_ext.model.provider import ModelOptions, build_model

    init_parallel(tp, pp)
    try:
        snapshot = find_snapshot(snapshot_dir, "--megatron-dir")
        arch = snapshot.arch
        input_ids = batch["input_ids"]
        model = build_model(arch, families.of(arch), ModelOptions(seq_length=input_ids.shape[1], dtype="float32", init_weights=False,
                                               parallel_output=False))
        load_for_inference(model, snapshot)
        images, layout = megatron_media(arch, batch)
        return megatron_logits(model, images, input_ids, arch.img_seq_len, arch.text.vocab_size, layout)
    finally:
        shutdown()


def _mrope_logits_rank(snapshot_dir: Path, tp: int, pp: int, inputs: dict) -> torch.Tensor:
    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.lora.checkpoint import load_for_inference
    from megatron_ext.model.provider import ModelOptions

    init_parallel(tp, pp)
    try:
        snapshot = find_snapshot(snapshot_dir, "--megatron-dir")
        length, vocab_size = inputs["input_ids"].shape[1], snapshot.arch.text.vocab_size
        model = families.build_model(snapshot.arch, ModelOptions(seq_length=length, dtype="float32", init_weights=False,
                                                                 parallel_output=False))
        load_for_inference(model, snapshot)
        with torch.no_grad():
            logits = mrope_forward(model.eval(), inputs)
        return _on_every_stage(logits[..., :vocab_size] if logits is not None else None, (1, length, vocab_size), "cpu")
    finally:
        shutdown()


def native_resolution_inputs(hf_dir: str | Path, arch, images: list, prompt: str) -> dict:
    """A native-resolution model's inputs for one user turn about `images` (each placed before the
    text; generation prompt appended), encoded by the trainer's task encoder with the tokenizer in `hf_dir`."""
    from megatron_ext.data.conversation import place_images
    from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder

    encoder = NativeResolutionTaskEncoder.for_model(str(hf_dir), arch, seq_length=arch.text.max_position_embeddings,
                                                    pad_token_id=arch.pad_token_id)
    return encoder.encode_prompt(place_images([{"role": "user", "content": prompt}], len(images)), images, [])


def compare(hf_dir: str | Path, megatron_dir: str | Path, tp: int | None = None, pp: int | None = None,
            images: list | None = None, prompt: str = DEFAULT_PROMPT) -> LogitStats:
    """HF vs Megatron (loaded at `tp` x `pp`, default: the layout it was saved with) in float32 on CPU,
    on a prompt about `images` (default: one noise image)."""
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks
    from megatron_ext.hf.processors import load_processor
    from megatron_ext.model.arch import LlavaArch

    snapshot = find_snapshot(megatron_dir, "--megatron-dir")
    tp, pp = tp or snapshot.tp, pp or snapshot.pp
    snapshot.arch.check_parallel(tp, pp)
    images = images or [synthetic_image()]
    if not isinstance(snapshot.arch, LlavaArch):
        inputs = native_resolution_inputs(hf_dir, snapshot.arch, images, prompt)
        reference = hf_logits(Path(hf_dir), {k: v for k, v in inputs.items() if k != "position_ids"})
        return logit_stats(reference, run_on_cpu_ranks(_mrope_logits_rank, tp * pp, snapshot.path, tp, pp, inputs))
    processor = load_processor(hf_dir, "--hf-dir")
    batch = process_inputs(processor, images, prompt)
    reference = hf_logits(Path(hf_dir), batch)
    logits = run_on_cpu_ranks(_megatron_logits_rank, tp * pp, snapshot.path, tp, pp, dict(batch))
    return logit_stats(reference, logits)
