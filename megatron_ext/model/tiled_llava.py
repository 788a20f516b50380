"""megatron-core's LLaVAModel for tiled LLaVAs (LLaVA-NeXT, OneVision): every image token is one
feature, laid out as transformers does (`tiling.py`).

megatron-core runs the tower and the projector on all tiles as one batch, as for LLaVA-1.5; this
subclass only reorders their output into each image's features (grid, unpadding, downsampling,
newlines, video pooling) before megatron-core puts them in the image tokens' places, each image
token being one position (`img_seq_len` 1). What the tiles are reaches `forward` as
`media_layout` (`tiling.layout_tensor`); video tokens are image tokens to megatron-core.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.model.arch import TilingArch
from megatron_ext.model.combined_layout import LaidOutLLaVAModel
from megatron_ext.model.tiling import Media, assemble, feature_count


class TiledLLaVAModel(LaidOutLLaVAModel):
    def __init__(self, *, tiling: TilingArch, tile: int, **kwargs):
        """`tile`: the tower's image size in pixels, which the grids are multiples of."""
        super().__init__(**kwargs)
        self.tiling = tiling
        self.tile = tile
        # Input ids carry one image token per feature, so megatron-core widens none of them.
        self.img_seq_len = 1
        self._layout: list[Media] | None = None
        self._image_tokens = 0
        if self.add_encoder:
            config = kwargs["language_transformer_config"]
            self.image_newline = torch.nn.Parameter(torch.empty(config.hidden_size, dtype=config.params_dtype))
            if config.perform_initialization:
                # As transformers initialises it.
                torch.nn.init.normal_(self.image_newline, std=1 / math.sqrt(config.hidden_size))

    def forward(self, images, input_ids, *args, media_layout: torch.Tensor | None = None,
                image_tokens: int | None = None, **kwargs):
        """LLaVAModel.forward; `media_layout`: the images' and videos' rows (`tiling.layout_tensor`, on
        the host), needed on the first pipeline stage when `images` holds any tile; `image_tokens`: how
        many image and video tokens `input_ids` holds, counted on the host (`ModelInputs`) so that the
        step reads nothing back from the device (counted here when not given)."""
        if self.tiling.video_token_index is not None:
            input_ids = input_ids.masked_fill(input_ids == self.tiling.video_token_index, self.image_token_index)
        if image_tokens is None:
            image_tokens = int((input_ids == self.image_token_index).sum())
        self._image_tokens = image_tokens
        kwargs["num_image_tiles"] = torch.ones(image_tokens, dtype=torch.int, device=input_ids.device)
        self._layout = None if media_layout is None else [Media(*row) for row in media_layout.tolist()]
        try:
            return super().forward(images, input_ids, *args, **kwargs)
        finally:
            self._layout = None

    def _preprocess_data(self, image_embeddings, language_embeddings, input_ids, *args, **kwargs):
        if self.add_encoder and image_embeddings is not None and image_embeddings.numel() > 0:
            image_embeddings = self._features(image_embeddings, input_ids)
        return super()._preprocess_data(image_embeddings, language_embeddings, input_ids, *args, **kwargs)

    def _features(self, tiles: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Projected tiles [patches, tiles, h] -> every feature as a one-position tile [1, features, h]."""
        if self._layout is None:
            raise ValueError("a tiled LLaVA needs the media_layout of its images")
        side = math.isqrt(tiles.shape[0])
        expected = sum(feature_count(m, self.tiling, self.tile, side) for m in self._layout)
        if expected != self._image_tokens:
            raise ValueError(f"the media layout gives {expected} image features, the input has "
                             f"{self._image_tokens} image tokens")
        return assemble(tiles.transpose(0, 1), self._layout, self.tiling, self.tile, self.image_newline)[None]
