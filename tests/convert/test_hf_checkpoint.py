"""ShardWriter (safetensors written tensor by tensor from a plan) and the dist-checkpoint chunk names (no processes)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext.checkpoint.keys import chunk_of_tensor, tensor_of_chunk
from megatron_ext.convert.hf_checkpoint import INDEX_FILE, WEIGHTS_FILE, ShardWriter, TensorSpec


def _tensors():
    return {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7, dtype=torch.int64),
            "big": torch.randn(40, 10), "c": torch.tensor(2.5), "d": torch.randn(2, 2).half()}


def _write(out, tensors, max_shard_size):
    writer = ShardWriter(out, max_shard_size, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()


def test_files_read_back_exactly_hold_at_most_the_size_limit_and_are_indexed(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_size=100)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    # [a b] [big] [c d]
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)] and not (tmp_path / WEIGHTS_FILE).exists()
    back = {}
    for file in files:
        part = load_file(tmp_path / file)
        assert sum(t.nbytes for t in part.values()) <= 100 or list(part) == ["big"]  # too big for any shard: alone
        back.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert sorted(back) == sorted(tensors) and all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in tensors.items())


def test_one_file_without_index_when_everything_fits(tmp_path):
    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_size=10**6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_FILE]
    back = load_file(tmp_path / WEIGHTS_FILE)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_tensor_other_than_the_planned_one_is_refused(tmp_path):
    writer = ShardWriter(tmp_path, 10**6, [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (2,), torch.float32)])
    with pytest.raises(RuntimeError, match="got a \\[2\\] torch.bfloat16"):
        writer.add("a", torch.zeros(2, dtype=torch.bfloat16))
    writer = ShardWriter(tmp_path, 10**6, [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (2,), torch.float32)])
    writer.add("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="b and maybe more were planned"):
        writer.close()


@pytest.mark.parametrize("name, shape, key, offsets, sizes", [
    ("language_model.decoder.layers.7.mlp.linear_fc1.weight", (8, 4), "language_model.decoder.layers.mlp.linear_fc1.weight",
     (7, 0, 0), (1, 8, 4)),
    ("vision_model.decoder.layers.0.self_attention.linear_qkv.bias", (6,), "vision_model.decoder.layers.self_attention.linear_qkv.bias",
     (0, 0), (1, 6)),
    ("language_model.embedding.word_embeddings.weight", (10, 4), "language_model.embedding.word_embeddings.weight", (0, 0), (10, 4)),
])
def test_layer_tensors_are_chunks_of_one_key_stacked_over_layers(name, shape, key, offsets, sizes):
    assert chunk_of_tensor(name, shape) == (key, offsets, sizes)
    assert tensor_of_chunk(key, offsets, sizes) == (name, tuple(slice(0, n) for n in shape))
    # A TP rank's chunk: the second half of the rows of layer 7.
    if offsets[0] == 7:
        assert tensor_of_chunk(key, (7, 4, 0), (1, 4, 4)) == (name, (slice(4, 8), slice(0, 4)))
