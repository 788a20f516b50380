"""LLaVA-NeXT and LLaVA-OneVision through generate.py, chat.py and benchmark.py: the Megatron
checkpoint (converted at TP2, run at TP2 or PP2) answers greedily with transformers' own tokens on
any-resolution images (one, two of one tile each, none) and, for OneVision, a video; the HF
checkpoint runs in its own class; lmms-eval gives the same answers through both sides."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.convert.compare import synthetic_image
from megatron_ext.eval.prompts import load_image, user_turn
from tests.helpers import run_script, run_torchrun

MAX_NEW_TOKENS = 10
FRAMES = 4
PROMPT = "What is in this picture?"
TWO_IMAGES = "Compare <image> with <image>."


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    """A wide and a tall image (grids of different shapes) and an 8-frame lossless video."""
    import av

    folder = tmp_path_factory.mktemp("tiled_media")
    paths = {"wide": folder / "wide.png", "tall": folder / "tall.png", "video": folder / "clip.mkv"}
    synthetic_image(0, (83, 50)).save(paths["wide"])
    synthetic_image(1, (50, 117)).save(paths["tall"])
    with av.open(str(paths["video"]), "w") as container:
        stream = container.add_stream("ffv1", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "bgr0"
        for i in range(8):
            frame = np.asarray(synthetic_image(20 + i, (64, 48)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return paths


@pytest.fixture(scope="module")
def hf_dirs(llava_next_clip, llava_onevision_siglip, tmp_path_factory) -> dict[str, Path]:
    """The tiny LLaVA-NeXT, and the tiny OneVision with its projector's output scaled down: at full
    scale its image features swamp the tiny text model, which then answers every image alike."""
    import shutil

    from safetensors.torch import load_file, save_file

    onevision = tmp_path_factory.mktemp("onevision_small_features") / "hf"
    shutil.copytree(llava_onevision_siglip, onevision)
    weights = load_file(onevision / "model.safetensors")
    for name in ("multi_modal_projector.linear_2.weight", "multi_modal_projector.linear_2.bias", "image_newline"):
        weights[name] = weights[name] * 0.002
    save_file(weights, onevision / "model.safetensors", metadata={"format": "pt"})
    return {"next": llava_next_clip, "onevision": onevision}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """Both converted to Megatron at TP2."""
    from megatron_ext.convert.to_megatron import convert

    out = tmp_path_factory.mktemp("tiled_megatron")
    return {name: convert(hf_dir, out / name, tp=2, pp=1) for name, hf_dir in hf_dirs.items()}


@pytest.fixture(scope="module")
def references(hf_dirs):
    from tests.eval.conftest import HFReference

    return {name: HFReference(hf_dir) for name, hf_dir in hf_dirs.items()}


def _requests(name: str, media: dict[str, Path], folder: Path) -> tuple[Path, list[dict]]:
    """The JSONL requests (an anyres image, two images, text; OneVision: a video, and a video with an image)."""
    lines = [{"image": str(media["wide"]), "prompt": PROMPT},
             {"image": [str(media["tall"]), str(media["wide"])], "prompt": TWO_IMAGES},
             {"prompt": "Hello, who are you?"}]
    if name == "onevision":
        lines += [{"video": str(media["video"]), "prompt": "What happens in this video?"},
                  {"video": str(media["video"]), "image": str(media["tall"]), "prompt": PROMPT}]
    path = folder / f"requests-{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, lines


def _expected(reference, lines: list[dict]) -> list[list[int]]:
    from megatron_ext.eval.videos import load_video

    expected = []
    for line in lines:
        files = line.get("image", [])
        images = [load_image(f) for f in ([files] if isinstance(files, str) else files)]
        videos = [load_video(line["video"], FRAMES)] if "video" in line else []
        turn = user_turn(line["prompt"], len(images), len(videos))
        expected.append(reference.greedy([turn], images, MAX_NEW_TOKENS, videos))
    return expected


def _answers(path: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,layout", [("next", "--tp"), ("onevision", "--pp")])
def test_megatron_greedy_tokens_equal_transformers_generate(name, layout, converted, references, media, tmp_path):
    requests, lines = _requests(name, media, tmp_path)
    answers = tmp_path / "answers.jsonl"
    run_torchrun(2, "scripts/eval/generate.py", "--megatron-dir", converted[name], layout, 2, "--input-jsonl", requests,
                 "--output-jsonl", answers, "--max-new-tokens", MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=300)
    expected = _expected(references[name], lines)
    assert _answers(answers) == expected
    # Every request answered differently: the answers depend on what the media are.
    assert len({tuple(tokens) for tokens in expected}) == len(expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hf_checkpoint_generates_in_its_own_class(hf_dirs, references, media, tmp_path):
    requests, lines = _requests("onevision", media, tmp_path)
    answers = tmp_path / "answers.jsonl"
    run_script("eval/generate.py", "--hf-dir", hf_dirs["onevision"], "--input-jsonl", requests, "--output-jsonl",
               answers, "--max-new-tokens", MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=200)
    assert _answers(answers) == _expected(references["onevision"], lines)
