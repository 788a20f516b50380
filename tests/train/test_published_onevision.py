"""A LLaVA-OneVision of the published 0.5B shape, whose tower is SigLIP so400m/14-384 (off its patch
grid: 27 patches and 6 pixels left per side), narrowed as tests/shapes narrows (every head count,
image, patch and grid as published): stage 2 trains it through run.py at TP2, packed, on anyres
images and a video, and the trained checkpoint's greedy answers equal transformers' on the model
exported back to HF."""

from __future__ import annotations

import json

import pytest

from megatron_ext.convert.compare import synthetic_image
from tests.shapes import build, llava_shapes, narrowed
from tests.support.helpers import run_ranks, run_script
from tests.support.hf_generate import HFReference
from tests.support.tiled_data import turns, write_video
from tests.support.training import launcher_args, metrics
from tests.train.test_stages import _changed_prefixes, _hf_tensors

pytestmark = [pytest.mark.multiprocess]

SHAPE = "llava-hf--llava-onevision-qwen2-0.5b-ov-hf"
FRAMES = 4
MAX_NEW_TOKENS = 8
# Wide and tall pictures: grids of 1 x 2 and 2 x 1 tiles of 384 pixels, unpadded (+ the base tile).
SIZES = [(800, 400), (380, 760)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(prepared dataset, its media): anyres images, a video, a text-only sample."""
    from megatron_ext.data.build import build_energon_dataset

    src = tmp_path_factory.mktemp("so400m_src")
    for i, size in enumerate(SIZES):
        synthetic_image(i, size).save(src / f"{i}.png")
    write_video(src / "clip.mp4", frames=8)
    records = [{"id": f"image{i}", "image": f"{i}.png", "conversations": turns("<image>\nWhat is it?", "Noise.")}
               for i in range(len(SIZES))]
    records += [{"id": "video", "video": "clip.mp4", "conversations": turns("<video>\nWhat happens?", "It brightens.")},
                {"id": "text", "conversations": turns("Say hi.", "Hi.")}]
    (src / "mix.json").write_text(json.dumps(records))
    out = build_energon_dataset(src / "mix.json", tmp_path_factory.mktemp("so400m_data") / "energon",
                                split_ratio="1,0,0", samples_per_shard=8, num_workers=0).output_dir
    return out, src


@pytest.mark.timeout(900)
def test_stage2_packed_at_tp2_trains_and_answers_as_transformers(tmp_path, data):
    from megatron_ext.convert.to_hf import convert as to_hf
    from megatron_ext.convert.to_megatron import convert as to_megatron
    from megatron_ext.eval.prompts import load_image, user_turn
    from megatron_ext.eval.videos import load_video

    dataset, media = data
    config = narrowed(llava_shapes()[SHAPE])
    assert (config["vision_config"]["image_size"], config["vision_config"]["patch_size"]) == (384, 14)
    hf_dir = build(config, tmp_path / "built")
    megatron = to_megatron(hf_dir, tmp_path / "megatron", tp=2, pp=1)
    save = tmp_path / "stage2"
    run_script("train/run.py", *launcher_args(2, megatron, dataset, save, stage=2, tp=2, micro_batch_size=1,
                                              global_batch_size=2, seq_length=4096, packing_seq_length=4096, lr=1e-2,
                                              train_iters=4, video_frames=FRAMES), timeout=600)
    losses = [record["loss"] for _, record in sorted(metrics(save).items())]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    trained = to_hf(save, tmp_path / "hf")
    prefixes, _ = _changed_prefixes(_hf_tensors(hf_dir), _hf_tensors(trained))
    assert prefixes == {"multi_modal_projector", "image_newline", "language_model"}

    requests = [{"image": str(media / "0.png"), "prompt": "What is it?"},
                {"image": str(media / "1.png"), "prompt": "What is it?"},
                {"video": str(media / "clip.mp4"), "prompt": "What happens?"}]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    run_ranks(2, "scripts/eval/generate.py", "--megatron-dir", save, "--tp", 2, "--input-jsonl",
                 tmp_path / "requests.jsonl", "--output-jsonl", tmp_path / "answers.jsonl", "--max-new-tokens",
                 MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=300)
    answers = [json.loads(line)["token_ids"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    reference = HFReference(trained)
    expected = []
    for request in requests:
        images = [load_image(request["image"])] if "image" in request else []
        videos = [load_video(request["video"], FRAMES)] if "video" in request else []
        expected.append(reference.greedy([user_turn(request["prompt"], len(images), len(videos))], images,
                                         MAX_NEW_TOKENS, videos))
    assert answers == expected
