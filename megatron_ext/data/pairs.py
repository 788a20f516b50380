"""The energon task encoder for preference pairs (DPO): each pair becomes one sample of two packed
sequences, the prompt with the chosen answer then the prompt with the rejected one.

The pair's images (and video) are decoded, tiled and processed once: the sample keeps them once and
`image_index` says which tiles each sequence's image tokens use (`model.shared_images` runs the
vision tower once on them). A pair is never split: it fits whole in a row (`--seq-length`, or
`--packing-seq-length` with several pairs per row) or is skipped as a bad sample; answers are not
truncated, since a cut answer is another preference. Only the final answer's completion is trained (the
loss mask), as TRL's DPO split makes it (`ChatTokenizer.encode`): a multi-turn prompt's assistant turns are context. Batch rows then hold whole pairs: segments
2k+1 and 2k+2 of a row are pair k's chosen and rejected sequences (`batching.LlavaBatch`).
"""

from __future__ import annotations

from megatron.energon import Sample, stateless

from megatron_ext.data.batching import EncodedSample
from megatron_ext.data.shard_format import preference_of
from megatron_ext.data.task_encoder import LlavaTaskEncoder


class PairTaskEncoder(LlavaTaskEncoder):
    @stateless
    def preencode_sample(self, sample: Sample) -> EncodedSample:
        images, prompt, chosen, rejected = preference_of(sample)
        videos = sample.videos
        # Only the answer the pair compares is trained (TRL's completion), not the assistant turns of a
        # multi-turn prompt: the same in both sequences, they would count in IPO's per-token
        # log-ratios, RPO's NLL and the log-probability metrics.
        sequences = [self.encode_conversation(sample, [*prompt, {"role": "assistant", "content": answer}], images,
                                              videos, completion=True) for answer in (chosen, rejected)]
        if any(s.num_truncated for s in sequences) or \
                sum(map(self.layout.combined_length, sequences)) > self.layout.sample_limit:
            raise ValueError(f"the pair (the prompt with each answer) does not fit in the sequence length "
                             f"{self.layout.max_length}")
        pair = self.layout.pack(sequences)
        pair.__key__ = sample.__key__
        shared = len(sequences[0].images)
        pair.repeat_of = [-1] * shared + list(range(shared))
        pair.paired = True
        return pair

    @stateless
    def postencode_sample(self, sample: EncodedSample) -> EncodedSample:
        """Each distinct image (tiled models: media group) processed once; `image_index` lists the
        tiles of every use in token order."""
        tiles, index, spans = [], [], []
        for entry, source in zip(sample.images, sample.repeat_of):
            if source < 0:
                new = self.media.tiles(entry) if self.media is not None else list(self.images([entry]))
                spans.append(range(len(tiles), len(tiles) + len(new)))
                tiles += new
            else:
                spans.append(spans[source])
            index += spans[-1]
        sample.images, sample.image_index, sample.repeat_of = tiles, index, None
        return sample
