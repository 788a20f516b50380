"""uint8 RGB pixels -> pixel_values bit for bit as transformers' processors compute them. HF has
two arithmetics:
- PIL-backend processors (`PixelTable`) rescale in float64 and cast to float32
  (`image_transforms.rescale`), then normalize in float32 (`image_transforms.normalize`). Both are
  per-value maps of a uint8 channel value, so a [3, 256] table of their results, computed with the
  same numpy operations in the same order, gives the same float32 values (torch.equal) with one
  lookup per value: numpy's `take` per channel, which costs a third of HF's two passes (an int64
  gather in torch costs twice as much as HF's).
- torchvision-backend processors, video processors among them (`FusedNormalize`), fold the
  rescale factor into mean and std in float32 (`_fuse_mean_std_and_rescale_factor`) and normalize
  once in float32.
"""

from __future__ import annotations

import numpy as np
import torch


class PixelTable:
    """Callable: uint8 [..., H, W, 3] array -> float32 [..., 3, H, W] tensor, rescaled and normalized."""

    def __init__(self, scale: float | None, mean=None, std=None):
        values = np.arange(256, dtype=np.float64)
        values = (values * scale).astype(np.float32) if scale is not None else values.astype(np.float32)
        table = np.broadcast_to(values, (3, 256))
        if mean is not None:
            mean, std = (np.broadcast_to(np.asarray(v, dtype=np.float32), 3) for v in (mean, std))
            table = (table - mean[:, None]) / std[:, None]
        self.table = np.ascontiguousarray(table, dtype=np.float32)

    @classmethod
    def of(cls, processor) -> PixelTable:
        """The table of a PIL-backend processor's rescale and normalize settings."""
        return cls(processor.rescale_factor if processor.do_rescale else None,
                   processor.image_mean if processor.do_normalize else None,
                   processor.image_std if processor.do_normalize else None)

    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        channels_first = np.ascontiguousarray(np.moveaxis(pixels, -1, -3))
        out = np.empty(channels_first.shape, dtype=np.float32)
        for channel in range(3):
            np.take(self.table[channel], channels_first[..., channel, :, :], out=out[..., channel, :, :])
        return torch.from_numpy(out)


class FusedNormalize:
    """Callable: uint8 [..., 3, H, W] tensor -> float32, as a torchvision-backend processor rescales
    and normalizes: the same torch operations in the same order (a table is slower here than
    torch's vectorized two passes)."""

    def __init__(self, processor):
        self.mean = self.std = self.scale = None
        if processor.do_normalize:
            mean, std = (torch.tensor(v, dtype=torch.float32) for v in (processor.image_mean, processor.image_std))
            if processor.do_rescale:  # folded into mean and std, by HF's very operations
                mean, std = (v * (1.0 / processor.rescale_factor) for v in (mean, std))
            self.mean, self.std = (v.view(-1, 1, 1) if v.ndim == 1 else v for v in (mean, std))
        elif processor.do_rescale:
            self.scale = processor.rescale_factor

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        values = pixels.to(torch.float32, memory_format=torch.contiguous_format)
        if self.mean is not None:
            return values.sub_(self.mean).div_(self.std)
        return values * self.scale if self.scale is not None else values
