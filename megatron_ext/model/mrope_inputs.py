"""A native-resolution micro batch (`data.native_resolution_encoder`'s, as a dict) as
`mrope_vlm.MRopeVisionLanguageModel.forward` arguments.

Each row is one sample padded at its end, so the layers' causal mask is all the attention needs
(nothing real attends to the padding); the positions are the batch's own [3, B, T] mRoPE positions.
Every image and video token is already one position (expanded by the task encoder), so the
sequence the model computes is the batch's rows as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.model.inputs import ModelInputs

_MEDIA = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class MRopeInputs:
    image_token_index: int
    dtype: torch.dtype  # compute dtype: pixel rows are cast to it
    device: torch.device
    img_seq_len: int = 1  # a media token is one position
    # What the trainer and `step_vision` ask of LLaVA's inputs: no host layout, hence no step-wide tower run.
    logits_where_loss: bool = False
    host_layout: bool = False
    vision_once_per_step: bool = False

    @classmethod
    def for_model(cls, model, device: torch.device) -> "MRopeInputs":
        return cls(model.image_token_id, model.config.params_dtype, device)

    def combined_length(self, input_ids: torch.Tensor) -> int:
        return input_ids.shape[1]

    @staticmethod
    def media_count(batch: dict) -> int:
        """Images and videos the micro batch holds."""
        return sum(batch[grid].shape[0] for _, grid in _MEDIA)

    def __call__(self, batch: dict) -> dict:
        kwargs = {name: self.to_device(batch[name]) for name in ("input_ids", "position_ids", "labels", "loss_mask")}
        for pixels, grid in _MEDIA:
            held = batch[grid].shape[0] > 0
            kwargs[pixels] = self.to_device(batch[pixels], self.dtype) if held else None
            kwargs[grid] = self.to_device(batch[grid]) if held else None
        return kwargs

    to_device = ModelInputs.to_device


def inputs_for(arch, model, device: torch.device):
    """The inputs of this rank's model of `arch`: LLaVA's (`ModelInputs`), or a native-resolution model's."""
    from megatron_ext.model.arch import LlavaArch

    if isinstance(arch, LlavaArch):
        return ModelInputs.for_model(arch, model, device)
    return MRopeInputs.for_model(model, device)
