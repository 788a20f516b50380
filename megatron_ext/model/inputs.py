"""A micro batch (the task encoder's `LlavaBatch` as a dict) as `LLaVAModel.forward` arguments.

Packed samples must not attend to each other, and each attention backend is told so its own way:
- te, sdpa: a one-row micro batch goes as THD (`PackedSeqParams`, cu_seqlens in the combined
  sequence, where an image token is `img_seq_len` positions). Transformer Engine needs it for
  packing and context parallelism, megatron-core's RoPE restarts positions at every sample, and
  the sdpa backend attends every sub-sequence in one kernel call. Unpacked one-row batches take
  the same path (one sub-sequence), so there is one way per backend.
- local (any micro batch size), sdpa with several packed rows: a dense block-diagonal mask,
  computed on the device from the segment ids.
- unpacked rows: the layers' causal mask; padding sits at the end of a row, where nothing real
  attends to it.

On a GPU the batch crosses from pinned host memory without blocking; the host only reads the
token-level batch (lengths, boundaries): nothing the size of the combined sequence is built there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.errors import UserError
from megatron_ext.model.packed_sequences import combined_seq_len, packed_attention_mask, thd_boundaries


@dataclass(frozen=True)
class ModelInputs:
    image_token_index: int
    img_seq_len: int
    seq_length: int  # the model's language_max_sequence_length
    pipeline_parallel: bool  # LLaVAModel then pads every batch to seq_length
    backend: str  # resolved: te | sdpa | local
    dtype: torch.dtype  # compute dtype: images are cast to it (the ViT's weights have it)
    device: torch.device
    tiled: bool = False  # a tiled LLaVA: the batch's media_layout goes to its forward
    video_token_index: int | None = None  # a tiled LLaVA's video token (None: no video)
    # The combined sequence's layout computed here, on the host (`combined_layout`), so the model
    # reads nothing back from the device; False: megatron-core's own preprocessing (for A/B benches).
    host_layout: bool = True
    # With host_layout: the last stage computes logits and loss only where the loss mask is set.
    logits_where_loss: bool = False
    # With host_layout: a frozen vision tower runs once per step over all its images (`step_vision`).
    vision_once_per_step: bool = True

    @classmethod
    def for_model(cls, arch, model, device: torch.device) -> "ModelInputs":
        """For this rank's LLaVAModel of `arch` (`provider.build_model`), under the current parallel state."""
        from megatron.core import parallel_state

        from megatron_ext.model.combined_layout import LaidOutLLaVAModel

        return cls(arch.image_token_index, arch.img_seq_len, model.language_model.max_sequence_length,
                   parallel_state.get_pipeline_model_parallel_world_size() > 1, model.attention_backend,
                   model.config.params_dtype, device, tiled=arch.tiling is not None,
                   video_token_index=arch.tiling.video_token_index if arch.tiling is not None else None,
                   host_layout=isinstance(model, LaidOutLLaVAModel),
                   logits_where_loss=getattr(model, "logits_where_loss", False))

    def combined_length(self, input_ids: torch.Tensor) -> int:
        return combined_seq_len(input_ids, self.image_token_index, self.img_seq_len, self.seq_length,
                                pad_to_max=self.pipeline_parallel)

    @staticmethod
    def media_count(batch: dict) -> int:
        """Vision tower inputs the micro batch holds (images, a tiled model's tiles)."""
        return batch["images"].shape[0]

    def __call__(self, batch: dict) -> dict:
        input_ids, segment_ids = batch["input_ids"], batch["segment_ids"]
        kwargs = {
            "images": self.to_device(batch["images"], self.dtype),
            "input_ids": self.to_device(input_ids),
            "position_ids": None,
            "attention_mask": None,
            "labels": self.to_device(batch["labels"]),
            "loss_mask": self.to_device(batch["loss_mask"]),
        }
        if batch.get("image_index") is not None:  # preference pairs: each pair's images held once
            kwargs["image_index"] = self.to_device(batch["image_index"])
        if self.tiled:
            # Read on the host (tiling.Media rows), so it stays there; the image (and video) tokens are
            # counted here, on the host copy of the ids, not read back from the device's.
            kwargs["media_layout"] = batch["media_layout"]
            media = input_ids == self.image_token_index
            if self.video_token_index is not None:
                media |= input_ids == self.video_token_index
            kwargs["image_tokens"] = int(media.sum())
        if self.host_layout:
            kwargs["layout"] = self.layout(batch).to(self.to_device)
            if batch.get("vision_features") is not None:
                kwargs["vision_features"] = batch["vision_features"]
        packed = int(segment_ids.max()) > 1
        length = self.combined_length(input_ids)
        if self.backend != "local" and input_ids.shape[0] == 1:
            kwargs["packed_seq_params"] = self.packed_seq_params(input_ids, segment_ids, length)
        elif packed:
            if self.backend == "te":
                raise UserError("packed micro batches of several rows cannot use Transformer Engine attention: "
                                "use --micro-batch-size 1 (one packed sequence per micro batch)")
            kwargs["attention_mask"] = packed_attention_mask(kwargs["input_ids"], self.to_device(segment_ids),
                                                             self.image_token_index, self.img_seq_len, length)
        return kwargs

    def layout(self, batch: dict):
        """Where the model puts each combined position's embedding, label and loss mask (host tensors)."""
        from megatron_ext.model.combined_layout import combined_layout

        input_ids = batch["input_ids"]
        if self.tiled and self.video_token_index is not None:
            # The tiled model treats video tokens as image tokens (`tiled_llava`).
            input_ids = input_ids.masked_fill(input_ids == self.video_token_index, self.image_token_index)
        return combined_layout(input_ids, batch["labels"], batch["loss_mask"], self.image_token_index,
                               self.img_seq_len, self.seq_length, self.pipeline_parallel, self.logits_where_loss)

    def to_device(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor on the compute device; to a GPU through pinned memory, without waiting
        (energon's loader pins its batches already on a GPU machine)."""
        if self.device.type == "cuda" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, dtype, non_blocking=True)

    def packed_seq_params(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, length: int):
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = thd_boundaries(input_ids, segment_ids, self.image_token_index, self.img_seq_len, length)
        cu_seqlens = self.to_device(torch.tensor(bounds, dtype=torch.int32))
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        # Samples are padded to what context parallelism needs, so the padded boundaries are the same.
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)
