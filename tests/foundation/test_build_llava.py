"""build_llava_jp.py: a LLaVA checkpoint transformers loads and runs, for CLIP and SigLIP towers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_ext.errors import UserError
from megatron_ext.hf.build_llava import build_llava
from tests.support.helpers import run_script


def _image(seed=0, size=(70, 60)):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def _load(path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def _batch(processor, text="What is in this picture?"):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=_image(), text=prompt, return_tensors="pt")


@pytest.mark.parametrize("fixture,num_patches", [("llava_clip", 16), ("llava_qwen2_siglip", 16)])
def test_checkpoint_loads_generates_and_expands_image_tokens(request, fixture, num_patches):
    path = request.getfixturevalue(fixture)
    model, processor = _load(path)
    config = model.config
    tokenizer = processor.tokenizer

    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    assert config.text_config.vocab_size == len(tokenizer)
    assert processor.image_token_id == config.image_token_id
    assert config.text_config.num_key_value_heads < config.text_config.num_attention_heads

    batch = _batch(processor)
    # 56x56 image, 14x14 patches: 16 image tokens (CLIP's class token is dropped by the "default" strategy).
    assert int((batch["input_ids"] == config.image_token_id).sum()) == num_patches == config.image_seq_length
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 4


def test_vision_features_follow_each_tower_family(llava_clip, llava_qwen2_siglip):
    clip = json.loads((llava_clip / "config.json").read_text())
    siglip = json.loads((llava_qwen2_siglip / "config.json").read_text())
    assert (clip["vision_feature_layer"], clip["vision_feature_select_strategy"]) == (-2, "default")
    assert (siglip["vision_feature_layer"], siglip["vision_feature_select_strategy"]) == (-1, "full")
    assert siglip["tie_word_embeddings"] is True and siglip["text_config"]["model_type"] == "qwen2"


def test_projector_maps_vision_width_to_text_width(llava_clip):
    model, _ = _load(llava_clip)
    projector = model.model.multi_modal_projector
    vision_width, text_width = model.config.vision_config.hidden_size, model.config.text_config.hidden_size
    assert vision_width != text_width
    assert projector.linear_1.weight.shape == (text_width, vision_width)
    assert projector.linear_2.weight.shape == (text_width, text_width)
    assert model.config.projector_hidden_act == "gelu" and projector.linear_1.bias is not None


def test_vocab_padding_keeps_real_token_logits(llava_clip, llava_padded):
    plain, processor = _load(llava_clip)
    padded, _ = _load(llava_padded)
    vocab = plain.config.text_config.vocab_size
    assert padded.config.text_config.vocab_size % 128 == 0 and padded.config.text_config.vocab_size > vocab
    assert padded.lm_head.weight.shape[0] == padded.config.text_config.vocab_size
    batch = _batch(processor)
    with torch.no_grad():
        reference = plain(**batch).logits
        logits = padded(**batch).logits
    torch.testing.assert_close(logits[..., :vocab], reference, rtol=0, atol=1e-6)


def test_refuses_non_empty_save_dir_unless_force(tmp_path, tiny_hf):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="--save-dir .* is not empty.*--force"):
        build_llava(target, str(tiny_hf["text"]), str(tiny_hf["vision-clip"]))
    build_llava(target, str(tiny_hf["text"]), str(tiny_hf["vision-clip"]), force=True)
    assert not (target / "keep.txt").exists() and (target / "config.json").is_file()


def test_failure_midway_leaves_nothing(tmp_path, tiny_hf, monkeypatch):
    from transformers import LlavaProcessor

    def broken_save(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(LlavaProcessor, "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        build_llava(tmp_path / "out", str(tiny_hf["text"]), str(tiny_hf["vision-clip"]))
    assert list(tmp_path.iterdir()) == []


def test_missing_tokenizer_is_one_clear_error(tmp_path, tiny_hf):
    import shutil

    text = tmp_path / "text-no-tokenizer"
    shutil.copytree(tiny_hf["text"], text)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (text / name).unlink()
    with pytest.raises(UserError, match="--text-model: cannot load the tokenizer"):
        build_llava(tmp_path / "out", str(text), str(tiny_hf["vision-clip"]))
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_errors_are_one_line(tmp_path, tiny_hf):
    missing = run_script("convert/build_llava_jp.py", "--save-dir", tmp_path / "a", "--text-model", tmp_path / "nope",
                         "--vision-model", tiny_hf["vision-clip"], check=False, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].startswith("error: --text-model")
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr

    wrong_tower = run_script("convert/build_llava_jp.py", "--save-dir", tmp_path / "b", "--text-model", tiny_hf["text"],
                             "--vision-model", tiny_hf["text"], check=False, timeout=120)
    assert wrong_tower.returncode == 2
    assert "vision model_type 'llama' is not supported" in wrong_tower.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cli_makes_tiny_models_then_llava(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    run_script("demo/make_tiny_hf_models.py", "--save-dir", tmp_path / "tiny", "--text-arch", "qwen2",
               "--tie-word-embeddings", timeout=180)
    text = AutoConfig.from_pretrained(tmp_path / "tiny" / "text")
    assert text.model_type == "qwen2" and text.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(tmp_path / "tiny" / "text").chat_template
    assert AutoConfig.from_pretrained(tmp_path / "tiny" / "vision-siglip").model_type == "siglip_vision_model"

    built = run_script("convert/build_llava_jp.py", "--save-dir", tmp_path / "llava", "--text-model",
                       tmp_path / "tiny" / "text", "--vision-model", tmp_path / "tiny" / "vision-siglip",
                       "--vocab-size-padding", timeout=180)
    config = json.loads((tmp_path / "llava" / "config.json").read_text())
    assert config["text_config"]["vocab_size"] % 128 == 0
    # transformers' notice of the mean resizing the build asks for says nothing to the user.
    assert "mean_resizing" not in built.stdout + built.stderr


def test_processor_renders_hf_structured_messages_as_the_trainer_does(tmp_path, tiny_hf):
    """lmms-eval, vLLM and `processor.apply_chat_template` send {"type": "image"} parts. With a text
    model whose template only prints string contents (as Llama-3's and Qwen2's do), the built
    processor still renders them as the training encoder renders "<image>\\n question": same ids."""
    import shutil

    from transformers import AutoProcessor, AutoTokenizer

    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.data.chat_template import resolve_chat_template
    from megatron_ext.eval.prompts import PromptEncoder

    text = tmp_path / "text"
    shutil.copytree(tiny_hf["text"], text)
    tokenizer = AutoTokenizer.from_pretrained(text)
    string_only = resolve_chat_template("llama-3", "en", tokenizer)[1]
    tokenizer.chat_template = string_only
    tokenizer.save_pretrained(text)
    processor = AutoProcessor.from_pretrained(build_llava(tmp_path / "llava", str(text), str(tiny_hf["vision-clip"])))
    images = [synthetic_image(0), synthetic_image(1, (40, 90))]
    structured = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "The second is taller."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    as_trained = [{"role": "user", "content": "<image>\n<image>\nCompare them."},
                  {"role": "assistant", "content": "The second is taller."}, {"role": "user", "content": "Why?"}]
    # HF's documented flow (lmms-eval's too): render, then let the processor add the special tokens.
    hf_text = processor.apply_chat_template(structured, add_generation_prompt=True)
    hf_ids = processor(images=images, text=hf_text, return_tensors="pt")["input_ids"]
    ours = PromptEncoder(processor, string_only).encode(as_trained, images).input_ids
    assert torch.equal(hf_ids, ours) and int((ours == processor.tokenizer.convert_tokens_to_ids("<image>")).sum()) == 32
    assert int((ours == processor.tokenizer.bos_token_id).sum()) == 1
    # The text model's template alone cannot render such messages (Llama-3's fails on a list content).
    with pytest.raises(TypeError):
        processor.tokenizer.apply_chat_template(structured, chat_template=string_only, tokenize=False)


@pytest.mark.parametrize("fixture,tile", [("llava_next_clip", 56), ("llava_onevision_siglip", 62)])
def test_tiled_archs_give_their_class_the_published_grids_and_a_processor_matching_the_model(request, fixture, tile):
    """--arch llava-next / llava-onevision: the HF class, grids of the tower's tiles (CLIP's 56 pixels,
    SigLIP's 62, off its patch grid), a fresh image_newline, and a processor whose expanded image tokens
    transformers' model accepts."""
    import transformers

    from megatron_ext.families import llava_kind
    from megatron_ext.hf.processors import load_processor

    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    kind = llava_kind(config)
    assert config["architectures"] == [kind.model_class]
    assert config["image_grid_pinpoints"] == kind.default_pinpoints(tile)
    model = getattr(transformers, kind.model_class).from_pretrained(path).eval()
    newline = model.model.image_newline
    assert newline.shape == (config["text_config"]["hidden_size"],) and 0.05 < newline.std() < 0.3  # ~1/sqrt(64)
    processor = load_processor(path, "--hf-dir")
    if kind.video:
        assert config["vision_aspect_ratio"] == "anyres_max_2"
        assert config["video_token_index"] == processor.tokenizer.convert_tokens_to_ids("<video>")
    batch = _batch(processor)
    assert int((batch["input_ids"] == config["image_token_index"]).sum()) > 16  # a base tile and a grid
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()


def test_image_grid_pinpoints_are_given_as_sizes_that_are_multiples_of_the_tile(tiny_hf, tmp_path):
    from megatron_ext.hf.build_llava import parse_pinpoints

    assert parse_pinpoints("56x112,112X56") == [[56, 112], [112, 56]]
    with pytest.raises(UserError, match=r"^--image-grid-pinpoints '56x112,big' is not a list of HEIGHTxWIDTH sizes"):
        parse_pinpoints("56x112,big")
    with pytest.raises(UserError, match=r"^--image-grid-pinpoints \[\[50, 100\]\] are not multiples of the tower's image size 56$"):
        build_llava(tmp_path / "bad", str(tiny_hf["text"]), str(tiny_hf["vision-clip"]), arch="llava-next",
                    image_grid_pinpoints=[[50, 100]])
    path = build_llava(tmp_path / "ok", str(tiny_hf["text"]), str(tiny_hf["vision-clip"]), arch="llava-next",
                       image_grid_pinpoints=[[56, 112], [112, 56]])
    assert json.loads((path / "config.json").read_text())["image_grid_pinpoints"] == [[56, 112], [112, 56]]
    assert not (tmp_path / "bad").exists()


ONEVISION_DIRS = ["llava_onevision_siglip", "onevision_own_video_settings"]
BUILDS = {  # fixture: (text model, vision tower, build_llava options)
    "llava_clip": ("text", "vision-clip", {}),
    "llava_onevision_siglip": ("qwen2", "vision-siglip", {"arch": "llava-onevision", "anyres_max": 2}),
}


def _image_and_video():
    from megatron_ext.convert.compare import synthetic_image

    return synthetic_image(0, (83, 50)), np.stack([np.asarray(synthetic_image(10 + i, (90, 60))) for i in range(3)])


STRUCTURED = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]}]


def _two_images():
    from megatron_ext.convert.compare import synthetic_image

    return [synthetic_image(0, (83, 50)), synthetic_image(1, (50, 117))]


@pytest.fixture(scope="module")
def with_torchvision(request, tiny_hf, tiny_qwen2_tied, tmp_path_factory) -> dict:
    """What transformers gives where torchvision is installed (tests/reference/torchvision_child), for every test
    below, all in one child: its start (torch, transformers, torchvision) is most of each one's time."""
    from tests.reference import torchvision_child

    image, video = _image_and_video()
    work = tmp_path_factory.mktemp("with_torchvision")
    requests = {}
    for fixture in ONEVISION_DIRS:
        requests["saved_processor", fixture] = ("saved_processor", {
            "hf_dir": str(request.getfixturevalue(fixture)), "messages": STRUCTURED, "images": [image], "videos": [video]})
    for fixture, (text, vision, options) in BUILDS.items():
        text_model = tiny_qwen2_tied if text == "qwen2" else tiny_hf[text]
        requests["build_llava", fixture] = ("build_llava", {
            "save_dir": str(work / fixture), "text_model": str(text_model), "vision_model": str(tiny_hf[vision]), **options})
        requests["our_processor", fixture] = ("our_processor", {
            "hf_dir": str(request.getfixturevalue(fixture)), "images": _two_images()})
    return dict(zip(requests, torchvision_child.call_many(work / "child", list(requests.values())), strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", ONEVISION_DIRS)
def test_onevision_directory_loads_in_transformers_with_its_video_processor(request, fixture, with_torchvision):
    """With torchvision (a child: tests/reference/torchvision_child), AutoProcessor loads a built OneVision as the
    full class, video processor included, renders HF's structured image + video messages, and gives
    the ids and pixel values this project's prompt encoder gives without torchvision (images: both
    with transformers' PIL backend), also where the video processor's settings are not the image
    processor's."""
    from megatron_ext.eval.prompts import PromptEncoder
    from megatron_ext.hf.processors import FrameProcessor, load_processor

    hf_dir = request.getfixturevalue(fixture)
    ours = load_processor(hf_dir, "--hf-dir")
    assert isinstance(ours.video_processor, FrameProcessor)
    image, video = _image_and_video()
    hf = with_torchvision["saved_processor", fixture]
    assert (hf["class"], hf["image_processor"], hf["video_processor"]) == (
        "LlavaOnevisionProcessor", "LlavaOnevisionImageProcessor", "LlavaOnevisionVideoProcessor")
    saved = json.loads((hf_dir / "processor_config.json").read_text())["video_processor"]
    assert (hf["video_settings"]["resample"], list(hf["video_settings"]["image_mean"])) == (saved["resample"], saved["image_mean"])
    assert hf["video_settings"]["size"]["height"] == hf["video_settings"]["size"]["width"] == 62
    as_trained = [{"role": "user", "content": "<image>\n<video>\nWhat happens?"}]
    encoded = PromptEncoder(ours, ours.chat_template).encode(as_trained, [image], [video])
    assert hf["text"] == ours.tokenizer.apply_chat_template(as_trained, chat_template=ours.chat_template, tokenize=False,
                                                            add_generation_prompt=True)
    assert torch.equal(hf["input_ids"], encoded.input_ids)
    # 3 frames of 4 x 4 SigLIP features pooled to 2 x 2, then one newline.
    assert int((encoded.input_ids == ours.tokenizer.convert_tokens_to_ids("<video>")).sum()) == 3 * 4 + 1
    assert sorted(encoded.media) == sorted(k for k in hf if k in ("pixel_values", "image_sizes", "batch_num_images",
                                                                 "pixel_values_videos"))
    for key, value in encoded.media.items():
        assert torch.equal(torch.as_tensor(hf[key]), torch.as_tensor(value)), key


def test_video_frames_take_the_saved_video_processors_settings(llava_onevision_siglip, onevision_own_video_settings,
                                                               tmp_path):
    from megatron_ext.data.video import load_frame_settings
    from megatron_ext.hf_loading import load_image_processor

    image_processor = load_image_processor(str(onevision_own_video_settings), "--hf-dir")
    own = load_frame_settings(onevision_own_video_settings, "--hf-dir", image_processor)
    assert (type(own).__name__, own.resample, list(own.image_mean)) == ("LlavaOnevisionVideoProcessor", 2, [0.25, 0.5, 0.75])
    # Saved without one (transformers itself finds none there): the image processor's settings.
    bare = tmp_path / "bare"
    shutil.copytree(llava_onevision_siglip, bare)
    config = json.loads((bare / "processor_config.json").read_text())
    video = config.pop("video_processor")
    (bare / "processor_config.json").write_text(json.dumps(config))
    assert load_frame_settings(bare, "--hf-dir", image_processor) is image_processor
    (bare / "processor_config.json").write_text(json.dumps({**config, "video_processor": {
        **video, "video_processor_type": "Qwen2VLVideoProcessor"}}))
    with pytest.raises(UserError, match=rf"^--hf-dir {bare}: its video processor Qwen2VLVideoProcessor is not supported "
                                        r"\(supported: LlavaOnevisionVideoProcessor\)$"):
        load_frame_settings(bare, "--hf-dir", image_processor)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", list(BUILDS))
def test_processor_saved_with_and_without_torchvision_is_the_same(request, fixture, with_torchvision):
    """Where torchvision is installed build-llava saves transformers' own video processor
    (OneVision); without, the same processor_config.json."""
    without = json.loads((request.getfixturevalue(fixture) / "processor_config.json").read_text())
    assert with_torchvision["build_llava", fixture] == without
    assert without.get("video_processor", {}).get("video_processor_type") == (
        "LlavaOnevisionVideoProcessor" if BUILDS[fixture][2] else None)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", list(BUILDS))
def test_where_torchvision_is_installed_our_processor_keeps_the_pil_images(request, fixture, with_torchvision):
    """transformers would load the torchvision-backend image processor there (its resize differs
    from the PIL one by a few levels); ours keeps the PIL one the data path reproduces: the same
    pixel values with and without torchvision."""
    from megatron_ext.hf.processors import load_processor

    hf = with_torchvision["our_processor", fixture]
    without = load_processor(request.getfixturevalue(fixture), "--hf-dir").image_processor
    assert hf["image_processor"] == type(without).__name__ and type(without).__name__.endswith("Pil")
    assert torch.equal(hf["pixel_values"], without(images=_two_images(), return_tensors="pt")["pixel_values"])
