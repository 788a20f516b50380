"""`megatron-ext-data inspect` for a native-resolution model (Qwen2.5-VL): each image as the model gets
it, smart-resized, with its 14-px patches and its 2x2 merged tokens drawn, checked in a real browser
against transformers' image processor and the trainer's task encoder."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from megatron.energon import Sample
from PIL import Image

from megatron_ext import families
from megatron_ext.config.options import TrainConfig
from megatron_ext.data.native_resolution import QWEN2_5_VL, image_inputs, read_clip, video_inputs
from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
from megatron_ext.pages.inspector_page import write_inspection
from megatron_ext.pages.native_sample import frames_of
from megatron_ext.pages.sample_encoding import EncoderSetup
from megatron_ext.pages.sample_sources import Selection
from tests.support.qwen2_5_vl import IMAGE_TOKEN, VIDEO_TOKEN, write_tiny_model
from tests.support.qwen_vl import noise
from tests.support.tiled_data import turns, write_video

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]  # a browser

TWO_IMAGES, VIDEO, TEXT = "000000000", "000000001", "000000002"
# (height, width): a wide one and a tall thin one, neither a multiple of 28 px
SIZES = ((37, 91), (1000, 17))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def page(tmp_path_factory, qwen_dir):
    """(the page, the LLaVA JSON's folder): two odd-sized images, a 6-frame video, text only."""
    src = tmp_path_factory.mktemp("qwen_pages")
    for i, (height, width) in enumerate(SIZES):
        Image.fromarray(noise(height, width, i)).save(src / f"{i}.png")
    write_video(src / "clip.mp4")
    records = [{"id": "two", "image": ["0.png", "1.png"], "conversations": turns("<image>\n<image>\nSame?", "No.")},
               {"id": "clip", "video": "clip.mp4", "conversations": turns("<image>\nWhat happens?", "It brightens.")},
               {"id": "text", "conversations": turns("Say hi.", "Hi.")}]
    (src / "mix.json").write_text(json.dumps(records))
    return write_inspection(src / "mix.json", src / "page.html", EncoderSetup(tokenizer_load_dir=str(qwen_dir)),
                            Selection(samples=3)), src


def _encoded(qwen_dir, src, images: list, videos: list, question: str, answer: str):
    """The trainer's encoder's sample of one conversation."""
    arch = families.read_model(json.loads((qwen_dir / "config.json").read_text()))
    encoder = NativeResolutionTaskEncoder.for_model(str(qwen_dir), arch, seq_length=1024)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return encoder.encode_conversation(Sample(__key__="x", __restore_key__=()), messages, images, videos)


def _stats(section) -> dict[str, str]:
    table = section.locator(".stats")
    return dict(zip(table.locator("td:nth-child(1)").all_inner_texts(), table.locator("td:nth-child(2)").all_inner_texts()))


def _svg_pixels(svg) -> np.ndarray:
    uri = svg.locator("image").get_attribute("href")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB"))


def test_each_image_shows_its_smart_resize_patches_and_merged_tokens_as_the_processor_makes_them(qwen_dir, page):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from tests.pages.browser import opened

    path, src = page
    images = [Image.open(src / f"{i}.png").convert("RGB") for i in range(len(SIZES))]
    grids = image_inputs(images, QWEN2_5_VL)["image_grid_thw"].tolist()  # transformers' processor
    tokens = [t * h * w // 4 for t, h, w in grids]
    encoded = _encoded(qwen_dir, src, images, [], "<image>\n<image>\nSame?", "No.")
    assert int((encoded.input_ids == IMAGE_TOKEN).sum()) == sum(tokens)
    with opened(path) as shown:
        assert shown.console_errors == [] and shown.requests == []
        section = shown.page.locator(f'section[data-key="{TWO_IMAGES}"]')
        assert section.locator(".block").all_inner_texts() == [f"image {i + 1}: {n:,} positions" for i, n in enumerate(tokens)]
        assert int(_stats(section)["image positions"].replace(",", "")) == sum(tokens)
        trained = int(encoded.loss_mask.sum())
        assert int(_stats(section)["trained tokens"]) == section.locator(".tok.trained").count() == trained > 0
        drawn = section.locator("div.native")
        assert drawn.count() == len(SIZES)
        for i, ((height, width), (t, h, w), n) in enumerate(zip(SIZES, grids, tokens)):
            figure, svg = drawn.nth(i), drawn.nth(i).locator("svg")
            resized = smart_resize(height, width, 28, QWEN2_5_VL.min_pixels, QWEN2_5_VL.max_pixels)
            assert (resized[0] // 14, resized[1] // 14) == (h, w)
            assert figure.get_attribute("data-grid-thw") == f"{t},{h},{w}" and figure.get_attribute("data-tokens") == str(n)
            assert svg.get_attribute("data-size") == f"{resized[1]}x{resized[0]}"
            assert svg.locator("rect.token").count() == n  # one box per merged token: its pad tokens
            assert svg.locator("line.patch").count() == (h - 1) + (w - 1)
            caption = section.locator("figure.native figcaption").nth(i).inner_text()
            assert f"grid_thw [1, {h}, {w}]" in caption and f"{n} <|image_pad|>" in caption
            # The picture is the processor's resized image, its rows read back in merge-block order.
            expected = np.asarray(images[i].resize((resized[1], resized[0]), Image.Resampling.BICUBIC))
            assert np.abs(_svg_pixels(svg).astype(int) - expected).max() <= 1
            assert svg.bounding_box()["width"] > 20
        assert shown.page.locator(f'section[data-key="{TEXT}"] div.native').count() == 0


def test_a_video_shows_its_frame_pairs_with_their_times_and_tokens(qwen_dir, page):
    from tests.pages.browser import opened

    path, src = page
    clip = read_clip(src / "clip.mp4", TrainConfig().video_frames)
    (t, h, w), = video_inputs(clip, QWEN2_5_VL)["video_grid_thw"].tolist()
    tokens = t * h * w // 4
    encoded = _encoded(qwen_dir, src, [], [str(src / "clip.mp4")], "<video>\nWhat happens?", "It brightens.")
    assert int((encoded.input_ids == VIDEO_TOKEN).sum()) == tokens
    with opened(path) as shown:
        section = shown.page.locator(f'section[data-key="{VIDEO}"]')
        assert section.locator(".block").inner_text() == f"video 1: {tokens:,} positions"
        strip = section.locator("div.strip.native")
        assert strip.get_attribute("data-grid-thw") == f"{t},{h},{w}" and t == 3  # 6 frames at 5 per second
        pairs = strip.locator("figure.pair")
        assert pairs.locator("figcaption").all_inner_texts() == ["pair 1: 0.10 s", "pair 2: 0.50 s", "pair 3: 0.90 s"]
        assert [pairs.nth(k).locator("svg").count() for k in range(t)] == [2] * t
        assert pairs.nth(0).locator("rect.token").count() == 2 * h * w // 4  # each frame of a pair shows its tokens
        assert f"{tokens} <|video_pad|> in the text" in section.locator("p.caption").inner_text()


def test_pixel_rows_turn_back_into_the_frames_they_were_cut_from():
    from megatron_ext.data.native_resolution import patch_rows

    frames = np.random.RandomState(0).rand(4, 3, 56, 84).astype(np.float32)
    rows, grid = patch_rows(torch.from_numpy(frames), QWEN2_5_VL)
    assert grid == [2, 4, 6]
    assert np.array_equal(frames_of(rows, tuple(grid), QWEN2_5_VL).numpy(), frames)


def test_packed_rows_hold_each_sample_at_its_expanded_length(qwen_dir, page):
    from megatron_ext.pages.sample_encoding import build_encoder, run_inspection
    from megatron_ext.pages.sample_sources import open_source

    _, src = page
    seq = 512  # the video's 420 positions leave room for one of the others beside it
    encoder = build_encoder(EncoderSetup(tokenizer_load_dir=str(qwen_dir),
                                         options={"seq_length": seq, "packing_seq_length": seq}))
    selection = Selection(samples=3, everything=True)
    found = run_inspection(open_source(src / "mix.json", "train", None, selection), encoder, everything=True, keys=())
    used = {s.key: s.positions for s in found.trained}
    assert used[VIDEO] == 41 + 420 and sorted(k for row in found.rows for k in row.keys) == sorted(used)
    assert all(row.lengths == [used[k] for k in row.keys] and row.length <= seq for row in found.rows)
    assert len(found.rows) == 2  # the video with the text-only sample; the two images alone
