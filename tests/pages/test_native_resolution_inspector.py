"""`megatron-ext-data inspect` for a native-resolution model (Qwen2.5-VL, Qwen3-VL): each image as the
model gets it, smart-resized, with its patches and its 2x2 merged tokens drawn, a video as its frame
pairs (Qwen3-VL's each after its time in the text), checked in a real browser against transformers'
image processor, Qwen3-VL's processor text and the trainer's task encoder."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
import torch
from megatron.energon import Sample
from PIL import Image

from megatron_ext import families
from megatron_ext.config.options import TrainConfig
from megatron_ext.data.native_resolution import QWEN2_5_VL, QWEN3_VL, image_inputs, read_clip, video_inputs
from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
from megatron_ext.pages.inspector_page import write_inspection
from megatron_ext.pages.native_sample import frames_of
from megatron_ext.pages.sample_encoding import EncoderSetup
from megatron_ext.pages.sample_sources import Selection
from tests.support import qwen2_5_vl, qwen3_vl
from tests.support.qwen_vl import IMAGE_TOKEN, VIDEO_TOKEN, noise, tiny_tokenizer
from tests.support.tiled_data import turns, write_video

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]  # a browser

TWO_IMAGES, VIDEO, TEXT = "000000000", "000000001", "000000002"
VIDEO_PAD = "<|video_pad|>"
# (height, width): a wide one and a tall thin one, neither a multiple of 28 px
SIZES = ((37, 91), (1000, 17))
FAMILIES = {"qwen2_5_vl": (qwen2_5_vl, QWEN2_5_VL), "qwen3_vl": (qwen3_vl, QWEN3_VL)}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The LLaVA JSON's folder: two odd-sized images, a 6-frame video, text only."""
    src = tmp_path_factory.mktemp("qwen_pages")
    for i, (height, width) in enumerate(SIZES):
        Image.fromarray(noise(height, width, i)).save(src / f"{i}.png")
    write_video(src / "clip.mp4")
    records = [{"id": "two", "image": ["0.png", "1.png"], "conversations": turns("<image>\n<image>\nSame?", "No.")},
               {"id": "clip", "video": "clip.mp4", "conversations": turns("<image>\nWhat happens?", "It brightens.")},
               {"id": "text", "conversations": turns("Say hi.", "Hi.")}]
    (src / "mix.json").write_text(json.dumps(records))
    return src


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, family):
    """The tiny model's config and tokenizer: all the page reads of it."""
    out = tmp_path_factory.mktemp(family)
    FAMILIES[family][0].tiny_config().save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def page(src, qwen_dir):
    """The page of the three samples."""
    return write_inspection(src / "mix.json", src / f"{qwen_dir.name}.html", EncoderSetup(tokenizer_load_dir=str(qwen_dir)),
                            Selection(samples=3))


@pytest.fixture(scope="module")
def shown(page):
    """The page opened in Chromium, once per family."""
    from tests.pages.browser import opened

    with opened(page) as shown:
        yield shown


def _encoded(qwen_dir, images: list, videos: list, question: str, answer: str):
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


def test_each_image_shows_its_smart_resize_patches_and_merged_tokens_as_the_processor_makes_them(family, qwen_dir, src,
                                                                                                 shown):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    vision = FAMILIES[family][1]
    images = [Image.open(src / f"{i}.png").convert("RGB") for i in range(len(SIZES))]
    grids = image_inputs(images, vision)["image_grid_thw"].tolist()  # transformers' processor
    tokens = [t * h * w // 4 for t, h, w in grids]
    encoded = _encoded(qwen_dir, images, [], "<image>\n<image>\nSame?", "No.")
    assert int((encoded.input_ids == IMAGE_TOKEN).sum()) == sum(tokens)
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
        resized = smart_resize(height, width, vision.factor, vision.min_pixels, vision.max_pixels)
        assert (resized[0] // vision.patch_size, resized[1] // vision.patch_size) == (h, w)
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


def test_a_video_shows_its_frame_pairs_with_their_times_and_tokens(family, qwen_dir, src, shown):
    vision = FAMILIES[family][1]
    clip = read_clip(src / "clip.mp4", TrainConfig().video_frames)
    (t, h, w), = video_inputs(clip, vision)["video_grid_thw"].tolist()
    per_pair = h * w // 4
    encoded = _encoded(qwen_dir, [], [str(src / "clip.mp4")], "<video>\nWhat happens?", "It brightens.")
    assert int((encoded.input_ids == VIDEO_TOKEN).sum()) == t * per_pair
    section = shown.page.locator(f'section[data-key="{VIDEO}"]')
    # Qwen2.5-VL's video is one run of pads in the text; Qwen3-VL's one run per frame pair.
    blocks = ([f"video 1: {t * per_pair:,} positions"] if vision.tokens_per_second else
              [f"video 1 pair {k + 1}: {per_pair} positions" for k in range(t)])
    assert section.locator(".block").all_inner_texts() == blocks
    assert int(_stats(section)["image positions"]) == t * per_pair
    strip = section.locator("div.strip.native")
    assert strip.get_attribute("data-grid-thw") == f"{t},{h},{w}" and t == 3  # 6 frames at 5 per second
    pairs = strip.locator("figure.pair")
    captions = [caption.split(";")[0] for caption in pairs.locator("figcaption").all_inner_texts()]
    assert captions == ["pair 1: 0.10 s", "pair 2: 0.50 s", "pair 3: 0.90 s"]
    assert [pairs.nth(k).locator("svg").count() for k in range(t)] == [2] * t
    assert pairs.nth(0).locator("rect.token").count() == 2 * per_pair  # each frame of a pair shows its tokens
    assert f"{t * per_pair} <|video_pad|> in the text" in section.locator("p.caption").inner_text()


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_a_qwen3_vl_video_shows_each_frame_pair_after_the_time_its_processor_writes(family, src, shown):
    """The tokens as transformers' Qwen3VLProcessor writes the video, each pair's pads one block, and
    each drawn pair with that time, its own grid and its pad count."""
    from tests.data.test_native_resolution import _hf_processor

    clip = read_clip(src / "clip.mp4", TrainConfig().video_frames)
    (t, h, w), = video_inputs(clip, QWEN3_VL)["video_grid_thw"].tolist()
    processor = _hf_processor(family, [clip])
    written = processor.replace_video_token(processor.video_processor(None), 0)
    pads = re.compile(f"(?:{re.escape(VIDEO_PAD)})+")
    numbers = iter(range(1, t + 1))
    as_blocks = pads.sub(lambda run: f"video 1 pair {next(numbers)}: {len(run.group()) // len(VIDEO_PAD)} positions", written)
    section = shown.page.locator(f'section[data-key="{VIDEO}"]')
    assert f"<|vision_start|>{as_blocks}<|vision_end|>" in section.locator(".tokens").inner_text()
    expected = re.findall(rf"(<[\d.]+ seconds>)<\|vision_start\|>({pads.pattern})<\|vision_end\|>", written)
    pairs = section.locator("figure.pair")
    drawn = [(pairs.nth(k).get_attribute("data-stamp"), pairs.nth(k).get_attribute("data-grid-thw"),
              int(pairs.nth(k).get_attribute("data-tokens"))) for k in range(pairs.count())]
    assert drawn == [(stamp, f"1,{h},{w}", len(run) // len(VIDEO_PAD)) for stamp, run in expected] and len(drawn) == t == 3
    assert [caption.split("; ")[1] for caption in pairs.locator("figcaption").all_inner_texts()] == [
        f"{stamp} in the text, grid_thw [1, {h}, {w}]: {n} {VIDEO_PAD}" for stamp, _, n in drawn]


@pytest.mark.parametrize("vision", [QWEN2_5_VL, QWEN3_VL], ids=FAMILIES)
def test_pixel_rows_turn_back_into_the_frames_they_were_cut_from(vision):
    from megatron_ext.data.native_resolution import patch_rows

    p = vision.patch_size
    frames = np.random.RandomState(0).rand(4, 3, 4 * p, 6 * p).astype(np.float32)
    rows, grid = patch_rows(torch.from_numpy(frames), vision)
    assert grid == [2, 4, 6]
    assert np.array_equal(frames_of(rows, tuple(grid), vision).numpy(), frames)


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_packed_rows_hold_each_sample_at_its_expanded_length(family, qwen_dir, src):
    from megatron_ext.pages.sample_encoding import build_encoder, run_inspection
    from megatron_ext.pages.sample_sources import open_source

    seq = 512  # the video's 420 positions leave room for one of the others beside it
    encoder = build_encoder(EncoderSetup(tokenizer_load_dir=str(qwen_dir),
                                         options={"seq_length": seq, "packing_seq_length": seq}))
    selection = Selection(samples=3, everything=True)
    found = run_inspection(open_source(src / "mix.json", "train", None, selection), encoder, everything=True, keys=())
    used = {s.key: s.positions for s in found.trained}
    assert used[VIDEO] == 41 + 420 and sorted(k for row in found.rows for k in row.keys) == sorted(used)
    assert all(row.lengths == [used[k] for k in row.keys] and row.length <= seq for row in found.rows)
    assert len(found.rows) == 2  # the video with the text-only sample; the two images alone
