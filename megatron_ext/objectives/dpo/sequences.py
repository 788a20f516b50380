"""Where a pair micro batch's sequences are, and their log-probabilities from the model's output.

Rows hold whole pairs: segments 2k+1 and 2k+2 of a row are pair k's chosen and rejected sequences
(`data.pairs`). The layout is read from the host batch; the sums run on the output's device with
nothing read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.model.inputs import ModelInputs
from megatron_ext.model.packed_sequences import combined_segment_ids


@dataclass(frozen=True)
class PairPositions:
    rows: torch.Tensor  # [P, 2] row of each pair's chosen and rejected sequence
    segments: torch.Tensor  # [P, 2] their segment ids
    tokens: torch.Tensor  # [P, 2] float: trained (answer) tokens of each
    most_segments: int
    segment_ids: torch.Tensor  # the batch's, on the host

    KEY = "pair_positions"

    @classmethod
    def of(cls, batch: dict) -> "PairPositions":
        """The micro batch's pairs, read once and kept in it: the reference pass, the loss and RPO's
        token count all ask."""
        if cls.KEY not in batch:
            batch[cls.KEY] = cls._read(batch["segment_ids"], batch["loss_mask"])
        return batch[cls.KEY]

    @classmethod
    def _read(cls, segment_ids: torch.Tensor, loss_mask: torch.Tensor) -> "PairPositions":
        rows, segments, tokens = [], [], []
        for row in range(segment_ids.shape[0]):
            counts = torch.bincount(segment_ids[row], weights=loss_mask[row].double())
            for chosen in range(1, int(segment_ids[row].max()) + 1, 2):
                rows.append([row, row])
                segments.append([chosen, chosen + 1])
                tokens.append([counts[chosen], counts[chosen + 1]])
        return cls(torch.tensor(rows, dtype=torch.long).reshape(-1, 2), torch.tensor(segments, dtype=torch.long).reshape(-1, 2),
                   torch.tensor(tokens, dtype=torch.float64).reshape(-1, 2).float(), int(segment_ids.max()), segment_ids)

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def logps(self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor, input_ids: torch.Tensor,
              inputs: ModelInputs) -> torch.Tensor:
        """[P, 2] float32: the sum of the answer tokens' log-probabilities of each sequence.
        `per_token_loss`, `loss_mask`: LLaVAModel's [B, S] output (cross entropy = -log p) in the
        combined space; `input_ids`: the batch's on the same device, as `inputs` laid it out."""
        device = per_token_loss.device
        combined = combined_segment_ids(input_ids, inputs.to_device(self.segment_ids), inputs.image_token_index,
                                        inputs.img_seq_len, per_token_loss.shape[1])
        sums = torch.zeros(per_token_loss.shape[0], self.most_segments + 1, dtype=torch.float32, device=device)
        sums.scatter_add_(1, combined, -(per_token_loss.float() * loss_mask.float()))
        return sums[self.rows.to(device, non_blocking=True), self.segments.to(device, non_blocking=True)]
