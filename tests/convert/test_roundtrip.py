"""HF -> Megatron -> HF at TP {1,2} x PP {1,2}: bit-exact tensors, logit parity, resharding, trainer snapshots.

llava_clip goes through every layout; every other model through TP2 x PP2, which splits both ways
(how each model's tensors split is checked at every layout at full size in test_published_shapes).

One process launch does all the converting, both ways (see convert_worker.py and export_worker.py);
the tests below check what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import hf_tensors, run_ranks

FIXTURES = {"clip": "llava_clip", "qwen": "llava_qwen2_siglip", "padded": "llava_padded", "qwen3": "llava_qwen3_siglip",
            "internvit": "llava_internvit", "gemma3": "llava_gemma3_siglip", "mistral": "llava_mistral_clip",
            "phi3": "llava_phi3_clip"}
# Plus "bf16": llava_clip saved in bfloat16, as most published checkpoints are.
MODELS = [*FIXTURES, "bf16"]
LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]
# What convert_worker.py converts: the first model at every layout, the others at TP2 x PP2.
CONVERTED = [("clip", layout) for layout in LAYOUTS] + [(name, "tp2pp2") for name in MODELS if name != "clip"]


def _bf16_copy(src: Path, dst: Path) -> Path:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    # Sharded with an index, as the Hub ships checkpoints.
    LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst, max_shard_size="300KB")
    AutoProcessor.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    """OUT/megatron/NAME/LAYOUT, OUT/hf/NAME/LAYOUT, OUT/logits, OUT/megatron/trained, OUT/hf/trained."""
    hf_dirs = {name: request.getfixturevalue(fixture) for name, fixture in FIXTURES.items()}
    out = tmp_path_factory.mktemp("roundtrip")
    hf_dirs["bf16"] = _bf16_copy(hf_dirs["clip"], out / "hf_bf16")
    run_ranks(4, "tests/convert/convert_worker.py", out, *(f"{n}={p}" for n, p in hf_dirs.items()), timeout=400)
    return out, hf_dirs



@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "layout"), CONVERTED)
def test_round_trip_gives_back_every_tensor_bit_for_bit(converted, name, layout):
    out, hf_dirs = converted
    original, back = hf_tensors(hf_dirs[name]), hf_tensors(out / "hf" / name / layout)
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    config = json.loads((out / "hf" / name / layout / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == json.loads((hf_dirs[name] / "config.json").read_text())["text_config"]["vocab_size"]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FIXTURES))
def test_exported_model_and_processor_load_in_transformers_without_missing_keys(converted, name):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    out, hf_dirs = converted
    exported = out / "hf" / name / "tp2pp2"
    _, info = LlavaForConditionalGeneration.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    prompt = "<image>\nWhat is in this picture?"
    ours, theirs = AutoProcessor.from_pretrained(exported), AutoProcessor.from_pretrained(hf_dirs[name])
    assert ours.tokenizer(prompt)["input_ids"] == theirs.tokenizer(prompt)["input_ids"]
    assert ours.chat_template == theirs.chat_template


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_converted_checkpoint_holds_its_own_metadata_and_tokenizer(converted):
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.families import complete_llava_config

    out, hf_dirs = converted
    snapshot = find_snapshot(out / "megatron" / "qwen" / "tp2pp2")
    assert snapshot.path.name == "release" and snapshot.iteration == 0
    assert (snapshot.meta["kind"], snapshot.tp, snapshot.pp, snapshot.dtype) == ("converted", 2, 2, "float32")
    # Stored complete (transformers' defaults filled in), so that reading it back needs no transformers.
    stored = json.loads((hf_dirs["qwen"] / "config.json").read_text())
    assert snapshot.hf_config == complete_llava_config(stored)
    assert (snapshot.tokenizer_dir / "tokenizer.json").read_bytes() == (hf_dirs["qwen"] / "tokenizer.json").read_bytes()
    assert (snapshot.tokenizer_dir / "processor_config.json").is_file()
    assert not list(snapshot.tokenizer_dir.glob("*.safetensors"))
    assert find_snapshot(out / "megatron" / "bf16" / "tp2pp2").dtype == "bfloat16"


def _logits(out, name, layout):
    return torch.load(out / "logits" / f"{name}-{layout}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MODELS)
def test_megatron_logits_match_hf_in_fp32_at_tp1_and_tp2_pp2(converted, name):
    from megatron_ext.convert.compare import hf_logits, logit_stats

    out, hf_dirs = converted
    inputs = torch.load(out / "logits" / f"{name}-inputs.pt")
    # Longer than the tiny Mistral's and Gemma 3's sliding windows (6 and 5 keys), so they matter.
    assert inputs["input_ids"].shape[-1] > 6
    reference = hf_logits(hf_dirs[name], inputs)
    assert reference.std() > 0.1  # logits that differ visibly, so the comparison can fail
    for layout in ("tp1pp1", "tp2pp2"):
        stats = logit_stats(reference, _logits(out, name, layout))
        assert stats.max_abs <= 1e-4, (layout, stats)
        assert stats.argmax_agree, (layout, stats)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FIXTURES))
def test_checkpoint_converted_at_tp2_pp2_gives_the_same_logits_at_the_other_layouts(converted, name):
    out, _ = converted
    at_tp2_pp2 = _logits(out, name, "tp2pp2")
    # llava_clip loaded at every layout; the others at TP1.
    for layout in ("tp1pp1", "tp2pp1", "tp1pp2") if name == "clip" else ("tp1pp1",):
        other = _logits(out, name, layout)
        torch.testing.assert_close(other, at_tp2_pp2, rtol=0, atol=1e-5)
        assert torch.equal(other.argmax(-1), at_tp2_pp2.argmax(-1))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_trainer_snapshot_saved_at_another_layout_converts_back_with_its_changes(converted):
    out, hf_dirs = converted
    original, back = hf_tensors(hf_dirs["clip"]), hf_tensors(out / "hf" / "trained")
    changed = "language_model.model.norm.weight"
    assert sorted(back) == sorted(original)
    assert torch.equal(back[changed], original[changed] + 1.0)
    assert all(torch.equal(back[key], tensor) for key, tensor in original.items() if key != changed)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_export_without_the_kept_aside_tensors_is_refused_naming_them(converted):
    out, _ = converted
    message = json.loads((out / "hf" / "refusals.json").read_text())["no_extra"]
    assert "hf_extra.safetensors is missing" in message
    assert "vision_tower.post_layernorm.weight" in message and "vision_tower.encoder.layers.2.mlp.fc1.weight" in message
    assert not (out / "hf_no_extra").exists() and not list(out.glob(".hf_no_extra*"))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_converting_back_reads_the_checkpoint_index_once_however_many_layers(converted, tmp_path, monkeypatch):
    """The tensors are read a layer at a time; the checkpoint's metadata (every chunk of every
    tensor: megabytes at published depths) is unpickled once, not at every read."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ext.convert import to_hf

    reads, read = [], FileSystemReader.read_metadata
    monkeypatch.setattr(FileSystemReader, "read_metadata", lambda self, *a, **k: reads.append(1) or read(self, *a, **k))
    out, hf_dirs = converted
    to_hf.convert(out / "megatron" / "clip" / "tp2pp2", tmp_path / "hf")
    assert sorted(hf_tensors(tmp_path / "hf")) == sorted(hf_tensors(hf_dirs["clip"]))
    assert len(reads) == 1
