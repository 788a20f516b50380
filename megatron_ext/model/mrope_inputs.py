"""A native-resolution micro batch (`data.native_resolution_encoder`'s, as a dict) as
`mrope_vlm.MRopeVisionLanguageModel.forward` arguments.

Unpacked rows are one sample each, padded at the end, so the layers' causal mask is all the
attention needs (nothing real attends to the padding). A packed row (one per micro batch) goes as
THD (`PackedSeqParams`, cu_seqlens at each sample's start), so its samples do not attend to each
other; the RoPE angles are then taken token by token (`rope_kernels`), from the batch's positions,
which restart at every sample. Every image and video token is already one position (expanded by the
task encoder), so the sequence the model computes is the batch's rows as they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_ext.errors import UserError
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.model.mrope_vlm import feature_order, media_rows
from megatron_ext.model.tower_inputs import attends_through_flash, takes_precomputed, tower_kwargs

# Per media kind: pixel rows, grids, (a preference pair's batch) which of them each use shows, and the
# model's arguments for where its tokens lie, which encoder rows they show and what the encoder
# computes from its grid.
_MEDIA = (("pixel_values", "image_grid_thw", "image_uses", "image_rows", "image_order", "image_tower_inputs"),
          ("pixel_values_videos", "video_grid_thw", "video_uses", "video_rows", "video_order", "video_tower_inputs"))


@dataclass(frozen=True)
class MRopeInputs:
    image_token_index: int
    dtype: torch.dtype  # compute dtype: pixel rows are cast to it
    device: torch.device
    backend: str  # resolved: te | sdpa | local
    video_token_index: int = -1
    # The encoder's patches per merged row side; None off the first pipeline stage, which places no media.
    merge_size: int | None = None
    img_seq_len: int = 1  # a media token is one position
    # What the trainer and `step_vision` ask of LLaVA's inputs: no host layout, hence no step-wide tower run.
    logits_where_loss: bool = False
    host_layout: bool = False
    vision_once_per_step: bool = False
    # Under pipeline parallelism rows are padded at their ends to seq_length: the stages exchange
    # activations of one fixed shape.
    seq_length: int = 0
    pipeline_parallel: bool = False
    # grid -> what the encoder computes from it (`tower_inputs`); None: the encoder computes it.
    tower_inputs: Callable[[torch.Tensor], dict] | None = None
    tower_flash: bool = False  # the encoder attends through a flash attention (`tower_inputs.attends_through_flash`)

    @classmethod
    def for_model(cls, model, device: torch.device) -> "MRopeInputs":
        from megatron.core import parallel_state

        encoder, compute = model.vision_model, model.tower_inputs
        precompute = encoder is not None and compute is not None and takes_precomputed()
        return cls(model.image_token_id, model.config.params_dtype, device, model.attention_backend,
                   video_token_index=model.video_token_id,
                   merge_size=encoder.spatial_merge_size if encoder is not None else None,
                   seq_length=model.language_model.max_sequence_length,
                   pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size() > 1,
                   tower_inputs=functools.partial(compute, encoder) if precompute else None,
                   tower_flash=precompute and attends_through_flash(encoder))

    def combined_length(self, input_ids: torch.Tensor) -> int:
        return self.seq_length if self.pipeline_parallel else input_ids.shape[1]

    @staticmethod
    def media_count(batch: dict) -> int:
        """Images and videos the micro batch holds."""
        return sum(batch[grid].shape[0] for _, grid, *_ in _MEDIA)

    def __call__(self, batch: dict) -> dict:
        if self.pipeline_parallel:
            batch = self._padded(batch)
        kwargs = {name: self.to_device(batch[name]) for name in ("input_ids", "position_ids", "labels", "loss_mask")}
        input_ids, segment_ids = batch["input_ids"], batch["segment_ids"]
        for (pixels, grid, uses, rows, order, tower), token in zip(_MEDIA, (self.image_token_index,
                                                                           self.video_token_index)):
            held = batch[grid].shape[0] > 0
            kwargs[pixels] = self.to_device(batch[pixels], self.dtype) if held else None
            kwargs[grid] = self.to_device(batch[grid]) if held else None
            if held and self.merge_size is not None:
                # Found on the host, from the batch it holds: on a GPU, finding them there would stop the host.
                kwargs[rows] = self.to_device(media_rows(input_ids == token))
                if uses in batch:
                    kwargs[order] = self.to_device(feature_order(batch[grid], batch[uses], self.merge_size))
            if held and self.tower_inputs is not None:
                kwargs[tower] = tower_kwargs(self.tower_inputs, batch[grid], self.to_device, self.tower_flash)
        if int(segment_ids.max()) > 1:
            if input_ids.shape[0] != 1 or self.backend == "local":
                # The causal mask of the bshd path would let a pack's samples attend to each other.
                raise UserError("packed native-resolution micro batches go as THD: use --micro-batch-size 1 and the sdpa "
                                "or te attention backend")
            kwargs["packed_seq_params"] = self.packed_seq_params(input_ids, segment_ids, input_ids.shape[1])
        return kwargs

    def _padded(self, batch: dict) -> dict:
        """The rows padded at their ends to seq_length: padding tokens at position 0, no loss, no sample."""
        extra = self.seq_length - batch["input_ids"].shape[1]
        rows = ("input_ids", "position_ids", "labels", "loss_mask", "segment_ids")
        return {**batch, **{name: torch.nn.functional.pad(batch[name], (0, extra)) for name in rows}}

    # LLaVA's host-to-device copy and THD boundaries (an image token is `img_seq_len` = 1 position here).
    to_device = ModelInputs.to_device
    packed_seq_params = ModelInputs.packed_seq_params


def inputs_for(arch, model, device: torch.device):
    """The inputs of this rank's model of `arch`: LLaVA's (`ModelInputs`), or a native-resolution model's."""
    from megatron_ext.model.arch import LlavaArch

    if isinstance(arch, LlavaArch):
        return ModelInputs.for_model(arch, model, device)
    return MRopeInputs.for_model(model, device)
