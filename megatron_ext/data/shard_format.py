"""The webdataset layout the dataset builder writes, and how readers turn a sample back into a conversation.

One sample is one conversation with zero, one or several images:
- ``KEY.json``: ``{"id", "question"}`` (the first human turn), plus ``"conversations"`` (LLaVA turns)
  when there is more than one exchange or a system turn;
- ``KEY.txt``: the first answer;
- the images, in the order their ``<image>`` markers appear: ``KEY.jpg`` or ``KEY.png`` for one
  image (the original README's layout), ``KEY.0.jpg``, ``KEY.1.png``, ... for several; none for a
  text-only conversation. JPEGs and PNGs are stored byte for byte (PNG keeps screenshots, charts
  and documents free of JPEG artefacts); other formats are re-encoded losslessly as PNG.

The prepared dataset's ``.nv-meta/dataset.yaml`` (`DATASET_YAML`) names `ConversationWebdataset`,
which loads each sample as a `ConversationSample` (and names the sample type, which ``energon info``
reads). Datasets prepared as `VQASample` (the original README's ``energon prepare`` field map; one
image) are read too: `conversation_of` takes either.

A preference pair (DPO data, ``--task preference``) holds its images (and video) once, with the
part names above, and ``KEY.json``: ``{"id", "conversations": [the prompt's LLaVA turns, ending
with the human turn that is answered, one marker per image and video], "chosen", "rejected"}``; no
``KEY.txt``. Its dataset.yaml (`PREFERENCE_DATASET_YAML`) names `PreferenceWebdataset`, which
loads each as a `PreferenceSample`; `preference_of` gives the trainer its parts.
"""


import io
import json
import re
from dataclasses import field
from pathlib import Path
from typing import Type

from megatron.energon import Sample, SampleDecoder, StandardWebdatasetFactory, VQASample, edataclass

from megatron_ext.data.conversation import (
    MALFORMED,
    BadConversation,
    place_images,
    place_videos,
    sample_messages,
    turn_messages,
)

# PIL format -> shard extension of the formats stored as they are.
KEPT_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png"}
# Modes a PNG holds; anything else (CMYK, YCbCr, ...) is converted to RGB before it is written.
_PNG_MODES = {"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"}
# Image parts: the extensions readers decode as images, with an optional "N." (Nth image) in front.
_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
_IMAGE_PART = re.compile(rf"^(?:(\d+)\.)?({'|'.join(_IMAGE_EXTENSIONS)})$")
VIDEO_PART = "video"


class ImageFileError(Exception):
    """An image file that cannot go into a shard; `missing` says whether it is absent or unreadable."""

    def __init__(self, detail: str, missing: bool):
        super().__init__(detail)
        self.missing = missing


def image_file_part(path: Path) -> tuple[str, bytes]:
    """(extension, bytes) of an image file as it is stored in a shard; checks that it decodes."""
    from PIL import Image

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageFileError(str(path), missing=True) from None
    except OSError as exc:
        raise ImageFileError(f"{path}: {exc.strerror}", missing=True) from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format in KEPT_FORMATS:
                return KEPT_FORMATS[image.format], data
            if image.mode not in _PNG_MODES:
                image = image.convert("RGB")
            out = io.BytesIO()
            image.save(out, "PNG")
            return "png", out.getvalue()
    except Image.UnidentifiedImageError:
        # PIL names the in-memory buffer it read ("<_io.BytesIO object at 0x...>"), not the file.
        raise ImageFileError(f"{path}: not an image format PIL can read", missing=False) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageFileError(f"{path}: {exc}", missing=False) from None


def image_part_names(extensions: list[str]) -> list[str]:
    """Shard part names of a sample's images, in order."""
    if len(extensions) == 1:
        return extensions
    return [f"{i}.{ext}" for i, ext in enumerate(extensions)]


def video_part_name(path: Path) -> str:
    """Shard part name of a sample's video file: its bytes are stored as they are."""
    return f"{VIDEO_PART}{path.suffix.lower() or '.bin'}"


def _is_video_part(name: str) -> bool:
    # webdataset's decoder hands its handlers the part name with a leading dot.
    return name.lstrip(".").split(".", 1)[0] == VIDEO_PART


def _image_in_its_own_mode(key: str, data: bytes):
    """webdataset handler: an image part as PIL in the file's own mode, a video part as its bytes
    (decoded by the task encoder, which samples its frames); None for other parts."""
    from PIL import Image

    if _is_video_part(key):
        return data
    if key.rsplit(".", 1)[-1].lower() not in _IMAGE_EXTENSIONS:
        return None
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


class ImageModeKeepingDecoder(SampleDecoder):
    """energon's decoder, except that images keep the mode of their file (alpha, palette, greyscale).

    energon's "pil" decoding converts to RGB by dropping the alpha channel; HF's image processors
    composite transparent pixels over white instead. Keeping the mode lets `data.images` convert
    as HF does, so a transparent PNG gives the pixels HF LLaVA sees for the same file.
    """

    def __init__(self):
        super().__init__(image_decode="pil")
        self._decoder.handlers.insert(0, _image_in_its_own_mode)
        self._config["image_mode"] = "as stored"


@edataclass
class ConversationSample(Sample):
    images: list  # decoded images (PIL), in the order of their <image> markers
    messages: list[dict]  # chat messages; `<image>` marks each image, `<video>` each video
    videos: list = field(default_factory=list)  # a video file's bytes, or a list of frames (PIL or uint8 arrays)
    record_id: str = ""  # the input record's "id" (the builder stores it), for tracing a sample back


def _json_part(raw: dict) -> dict:
    meta = raw.get("json")
    if not isinstance(meta, dict):
        raise BadConversation(MALFORMED, f"sample {raw.get('__key__')} has no json part with its text")
    return meta


def _media(raw: dict) -> dict:
    """A decoded webdataset sample's images (in their markers' order) and videos."""
    numbered = [(match, value) for name, value in raw.items() if (match := _IMAGE_PART.match(name))]
    images = [value for _, value in sorted(numbered, key=lambda item: int(item[0].group(1) or -1))]
    return {"images": images, "videos": [value for name, value in raw.items() if _is_video_part(name)]}


def conversation_fields(raw: dict) -> dict:
    """A decoded webdataset sample's `ConversationSample` fields; raises BadConversation (energon's
    error handler then skips the sample)."""
    meta = _json_part(raw)
    return {**_media(raw), "messages": sample_messages(meta.get("conversations") or meta.get("question"), raw.get("txt")),
            "record_id": str(meta.get("id", ""))}


def _decoded_raw(parts: dict) -> dict:
    """What energon's decoder makes of a sample's encoded `parts` (a `sources.ShardSample`'s)."""
    raw = {"__key__": parts["__key__"]}
    for name, data in parts.items():
        if name == "json":
            raw[name] = json.loads(data)
        elif name == "txt":
            raw[name] = data
        elif name != "__key__":
            raw[name] = _image_in_its_own_mode(name, data)
    return raw


def decoded_sample(parts: dict) -> ConversationSample:
    """The `ConversationSample` energon would load from a sample's encoded `parts` (a
    `sources.ShardSample`'s), without writing a shard; raises BadConversation as loading does."""
    return ConversationSample(__key__=parts["__key__"], __restore_key__=(), **conversation_fields(_decoded_raw(parts)))


class ConversationWebdataset(StandardWebdatasetFactory[ConversationSample]):
    """energon's dataset factory for shards in this layout."""

    def __init__(self, path, *, sample_type: Type[ConversationSample] = ConversationSample, **kwargs):
        # `sample_type` is in dataset.yaml for `energon info`; this factory always makes ConversationSamples.
        # energon's config parser reads its annotation at run time (so no `from __future__ import annotations`).
        super().__init__(path, sample_type=ConversationSample, sample_loader=conversation_fields,
                         part_filter=lambda part: True, **kwargs)


def _dataset_yaml(factory: type, sample_type: type) -> dict:
    return {"__module__": __name__, "__class__": factory.__name__,
            "sample_type": {"__module__": __name__, "__class__": sample_type.__name__}}


DATASET_YAML = _dataset_yaml(ConversationWebdataset, ConversationSample)


@edataclass
class PreferenceSample(Sample):
    images: list  # decoded images (PIL), in the order of their <image> markers
    prompt: list[dict]  # chat messages ending with the user turn answered; one marker per image and video
    chosen: str
    rejected: str
    videos: list = field(default_factory=list)  # as ConversationSample's
    record_id: str = ""  # as ConversationSample's


def _checked_prompt(prompt: list[dict], num_images: int, num_videos: int) -> list[dict]:
    """`prompt` with one marker per image and video placed; raises BadConversation unless it ends
    with the user turn that is answered."""
    if not prompt or prompt[-1].get("role") != "user":
        raise BadConversation(MALFORMED, "the prompt does not end with a user turn")
    return place_videos(place_images(prompt, num_images), num_videos)


def preference_fields(raw: dict) -> dict:
    """A decoded webdataset sample's `PreferenceSample` fields; raises BadConversation (energon's
    error handler then skips the sample)."""
    meta, media = _json_part(raw), _media(raw)
    chosen, rejected = meta.get("chosen"), meta.get("rejected")
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        raise BadConversation(MALFORMED, f"sample {raw.get('__key__')} needs string 'chosen' and 'rejected'")
    prompt = _checked_prompt(turn_messages(meta.get("conversations")), len(media["images"]), len(media["videos"]))
    return {**media, "prompt": prompt, "chosen": chosen, "rejected": rejected, "record_id": str(meta.get("id", ""))}


def decoded_preference_sample(parts: dict) -> PreferenceSample:
    """The `PreferenceSample` energon would load from a pair's encoded `parts`, as `decoded_sample`."""
    return PreferenceSample(__key__=parts["__key__"], __restore_key__=(), **preference_fields(_decoded_raw(parts)))


class PreferenceWebdataset(StandardWebdatasetFactory[PreferenceSample]):
    """energon's dataset factory for preference pairs in this layout."""

    def __init__(self, path, *, sample_type: Type[PreferenceSample] = PreferenceSample, **kwargs):
        # As ConversationWebdataset's.
        super().__init__(path, sample_type=PreferenceSample, sample_loader=preference_fields,
                         part_filter=lambda part: True, **kwargs)


PREFERENCE_DATASET_YAML = _dataset_yaml(PreferenceWebdataset, PreferenceSample)


def preference_of(sample: PreferenceSample) -> tuple[list, list[dict], str, str]:
    """(images, prompt messages with one `<image>` per image and one `<video>` per video, chosen,
    rejected) of a pair; raises BadConversation for a pair the trainer cannot use."""
    if not sample.chosen.strip() or not sample.rejected.strip():
        raise BadConversation(MALFORMED, "an empty chosen or rejected answer")
    prompt = _checked_prompt(sample.prompt, len(sample.images), len(sample.videos))
    return sample.images, prompt, sample.chosen, sample.rejected


def videos_of(sample: ConversationSample | VQASample) -> list:
    """The sample's videos, in the order of their `<video>` markers (a VQASample has none)."""
    return sample.videos if isinstance(sample, ConversationSample) else []


def conversation_of(sample: ConversationSample | VQASample) -> tuple[list, list[dict]]:
    """(images, messages with one `<image>` per image and one `<video>` per video of `videos_of`)
    of a ConversationSample or a VQASample; raises BadConversation for a conversation the trainer
    cannot use."""
    if isinstance(sample, ConversationSample):
        images, messages = sample.images, sample.messages
    else:
        images = [sample.image] if sample.image is not None else []
        messages = sample_messages(sample.context, sample.answers)
    return images, place_videos(place_images(messages, len(images)), len(videos_of(sample)))
