"""Evaluation samples from a prepared energon dataset: images, the prompt turns, the reference answer.

Samples are read with energon (the split's shards in order, no shuffling) through a task encoder that
keeps them decoded, and turned into chat messages exactly as the training task encoder does
(`megatron_ext.data.shard_format.conversation_of`). The last assistant turn is the reference; the
turns before it are the prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron.energon import Sample, TaskEncoder, WorkerConfig, get_loader, get_val_dataset

from megatron_ext.data.conversation import BadConversation
from megatron_ext.data.prepared import require_split
from megatron_ext.data.shard_format import ImageModeKeepingDecoder, conversation_of

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


class DecodedSamples(TaskEncoder):
    """Leaves samples decoded but otherwise untouched; a 'batch' is the list of its samples."""

    decoder = ImageModeKeepingDecoder()

    def batch(self, samples: list) -> list:
        return samples


def eval_sample(sample: Sample) -> EvalSample:
    """Raises BadConversation for a sample the trainer could not use either."""
    images, messages = conversation_of(sample)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return EvalSample(key=sample.__key__, images=images, messages=messages[:last], reference=messages[last]["content"])


def read_samples(data_path: str | Path, split: str = "val", limit: int | None = None) -> list[EvalSample]:
    """The first `limit` samples (all when None) of a split, in order; the same on every rank."""
    require_split(data_path, split)
    # One reader for the whole split, whatever the data-parallel layout: callers split the samples themselves.
    whole_split = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(str(data_path), split_part=split, worker_config=whole_split, batch_size=1,
                              limit=limit, task_encoder=DecodedSamples())
    samples = []
    for batch in get_loader(dataset):
        for sample in batch:
            try:
                samples.append(eval_sample(sample))
            except BadConversation as exc:
                log.warning("sample %s skipped: %s", sample.__key__, exc)
    return samples
