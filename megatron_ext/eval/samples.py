"""Evaluation samples from a prepared energon dataset: images, the prompt turns, the reference answer.

Samples are read with energon (the split's shards in order, no shuffling) through a task encoder that
keeps them as decoded `VQASample`s, and turned into chat messages exactly as the training task
encoder does (`megatron_ext.data.conversation`). The last assistant turn is the reference; the
turns before it are the prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron.energon import SampleDecoder, TaskEncoder, VQASample, WorkerConfig, get_loader, get_val_dataset

from megatron_ext.data.conversation import BadConversation, place_images, sample_messages
from megatron_ext.data.prepared import require_split

log = logging.getLogger(__name__)


@dataclass
class EvalSample:
    key: str
    images: list  # PIL images
    messages: list[dict]  # the conversation up to (not including) the last assistant turn
    reference: str

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


class _DecodedSamples(TaskEncoder):
    """Leaves samples decoded but otherwise untouched; a 'batch' is the list of its samples."""

    decoder = SampleDecoder(image_decode="pil")

    def batch(self, samples: list) -> list:
        return samples


def eval_sample(sample: VQASample) -> EvalSample:
    """Raises BadConversation for a sample the trainer could not use either."""
    images = [sample.image] if sample.image is not None else []
    messages = place_images(sample_messages(sample.context, sample.answers), len(images))
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return EvalSample(key=sample.__key__, images=images, messages=messages[:last], reference=messages[last]["content"])


def read_samples(data_path: str | Path, split: str = "val", limit: int | None = None) -> list[EvalSample]:
    """The first `limit` samples (all when None) of a split, in order; the same on every rank."""
    require_split(data_path, split)
    # One reader for the whole split, whatever the data-parallel layout: callers split the samples themselves.
    whole_split = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(str(data_path), split_part=split, worker_config=whole_split, batch_size=1,
                              limit=limit, task_encoder=_DecodedSamples())
    samples = []
    for batch in get_loader(dataset):
        for sample in batch:
            try:
                samples.append(eval_sample(sample))
            except BadConversation as exc:
                log.warning("sample %s skipped: %s", sample.__key__, exc)
    return samples
