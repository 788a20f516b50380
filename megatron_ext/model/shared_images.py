"""LLaVA models whose image features can serve several sequences of a micro batch.

A preference pair's chosen and rejected sequences hold the same images (they differ only in the
answer). The batch then carries each pair's images once and `image_index`: for every image (tile)
its rows' image tokens take, in reading order, the entry of `images` it uses. The vision tower and
projector run once on `images`; their output is picked per use before megatron-core puts features
in the image tokens' places. Gradients of the shared features add up over their uses, as they
would with the images repeated. Without `image_index` the model is megatron-core's own.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def with_shared_images(model_cls: type) -> type:
    """`model_cls` (megatron-core's LLaVAModel or a subclass) taking `image_index` in forward."""

    class SharedImages(model_cls):
        _image_index: torch.Tensor | None = None

        def forward(self, images, input_ids, *args, image_index: torch.Tensor | None = None, **kwargs):
            """`image_index`: long [uses] on the model's device, or None (every image used once)."""
            if image_index is not None and getattr(self, "tiling", None) is None:
                # megatron-core counts one tile per image use; a tiled model counts its own.
                kwargs["num_image_tiles"] = torch.ones(image_index.shape[0], dtype=torch.int, device=image_index.device)
            self._image_index = image_index
            try:
                return super().forward(images, input_ids, *args, **kwargs)
            finally:
                self._image_index = None

        def _preprocess_data(self, image_embeddings, *args, **kwargs):
            # [img_seq_len, tiles, h] out of the projector: the tiles each use takes.
            if self._image_index is not None and self.add_encoder and image_embeddings is not None \
                    and image_embeddings.numel() > 0:
                image_embeddings = image_embeddings.index_select(1, self._image_index)
            return super()._preprocess_data(image_embeddings, *args, **kwargs)

    SharedImages.__name__ = SharedImages.__qualname__ = model_cls.__name__
    return SharedImages
