"""Chat messages and images -> the token ids both generators take, rendered as in training.

Messages follow the data pipeline's convention (`megatron_ext.data.conversation`): string contents
with a literal `<image>` where each image goes. They are rendered with the same chat template the
trainer uses (`megatron_ext.data.chat_template`), tokenized as the task encoder tokenizes (special
tokens added unless the text starts with the BOS: `chat_template.needs_special_tokens`), and
passed through the checkpoint's HF processor (`hf.processors.load_processor`), which expands every
`<image>` (and OneVision's `<video>`) into one token per embedding. A prompt's images are one
sample's: OneVision's processor makes each image one tile when there are several, as its training did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.data.chat_template import needs_special_tokens
from megatron_ext.data.conversation import IMAGE_MARKER, BadConversation, place_images
from megatron_ext.data.images import fit_aspect
from megatron_ext.errors import UserError
from megatron_ext.eval.videos import load_video
from megatron_ext.families.llava import VIDEO_TOKEN as VIDEO_MARKER


def load_image(path: str | Path, flag: str = "--image"):
    """A PIL image in the file's own mode (the processor converts to RGB as in training), or a one-line
    UserError naming the file."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path).expanduser()
    try:
        image = Image.open(path)
        image.load()
        return image
    except FileNotFoundError:
        raise UserError(f"{flag} {path} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{flag} {path} cannot be opened as an image ({reason})") from None


def user_turn(text: str, num_images: int, num_videos: int = 0) -> dict:
    """A user message about `num_images` images and `num_videos` videos: where `text` puts its
    `<image>` / `<video>` markers, else each before the text (LLaVA's `<image>\\n question` layout,
    the images, then the videos). A UserError when the markers are not one per image and one per video."""
    markers = text.count(VIDEO_MARKER)
    if markers == 0:
        text = f"{VIDEO_MARKER}\n" * num_videos + text
    elif markers != num_videos:
        raise UserError(f"the prompt has {markers} {VIDEO_MARKER} markers for {num_videos} videos: "
                        f"give one {VIDEO_MARKER} per video, or none")
    try:
        return place_images([{"role": "user", "content": text}], num_images)[0]
    except BadConversation as exc:
        raise UserError(f"the prompt has {exc.detail}: give one {IMAGE_MARKER} per image, or none") from None


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """End-of-turn ids: the tokenizer's eos plus any eos ids of the generation config."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(generation_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra] if extra is not None else []
    return sorted(set(ids))


@dataclass(frozen=True)
class EncodedPrompt:
    input_ids: torch.Tensor  # [1, S] long, every image and video expanded to one token per embedding (HF layout)
    # The processor's other model inputs (pixel_values, image_sizes, batch_num_images,
    # pixel_values_videos), as the HF model takes them; empty without images and videos.
    media: dict[str, torch.Tensor]
    # A native-resolution model's mRoPE positions [3, 1, S] (T, H, W), as training computes them; None for LLaVAs.
    position_ids: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions the language model sees (image embeddings included)."""
        return self.input_ids.shape[1]


class PromptEncoder:
    """Renders conversations with one chat template and encodes them with the checkpoint's processor."""

    def __init__(self, processor, template: str, image_aspect: str = "crop"):
        self.processor = processor
        self.image_aspect = image_aspect
        self.tokenizer = processor.tokenizer
        self.template = template

    def render(self, messages: list[dict]) -> str:
        """The conversation's text, ending with the prompt for the assistant's next turn."""
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)

    def check_takes_videos(self) -> None:
        """A one-line UserError unless the model takes videos (its processor has a video token)."""
        if getattr(self.processor, "video_token", None) is None:
            raise UserError("this model takes no videos (LLaVA-OneVision does)")

    def load_video(self, path: str | Path, frames: int, flag: str = "--video"):
        """What `encode` takes of a video file: `frames` uint8 frames sampled uniformly."""
        return load_video(path, frames, flag)

    def encode(self, messages: list[dict], images: list, videos: list = ()) -> EncodedPrompt:
        """`videos`: uint8 frames [n, H, W, 3] each (`videos.load_video`)."""
        for marker, media in ((IMAGE_MARKER, images), (VIDEO_MARKER, videos)):
            markers = sum(m["content"].count(marker) for m in messages)
            if markers != len(media):
                raise ValueError(f"{markers} {marker} markers for {len(media)} media")
        if videos:
            self.check_takes_videos()
        images = [fit_aspect(image, self.processor.image_processor, self.image_aspect) for image in images]
        text = self.render(messages)
        media = {}
        if images:
            media["images"] = [images]
        if videos:
            media["videos"] = list(videos)
        batch = self.processor(text=text, return_tensors="pt", add_special_tokens=needs_special_tokens(self.tokenizer, text),
                               **media)
        return EncodedPrompt(batch["input_ids"], {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")})


class NativeResolutionPromptEncoder:
    """Prompts for a native-resolution model (Qwen2.5-VL, Qwen3-VL), encoded by the trainer's task
    encoder (`data/native_resolution_encoder.py`): each `<image>` / `<video>` its vision run, the chat
    template's rendering with the prompt for the assistant's turn, every pad expanded to its merged
    patch count, the media's pixel rows and grids, and the mRoPE positions, as training computes them.
    `media` holds what transformers' `generate` takes besides the ids (the token types included)."""

    def __init__(self, task_encoder):
        self.task_encoder = task_encoder
        self.tokenizer = task_encoder.chat.tokenizer

    def check_takes_videos(self) -> None:
        """Every native-resolution model takes videos."""

    def load_video(self, path: str | Path, frames: int, flag: str = "--video"):
        """`frames` frames sampled uniformly, with the times the positions are computed from."""
        from megatron_ext.data.native_resolution import read_clip

        return read_clip(Path(path).expanduser(), frames, name=f"{flag} {path}")

    def encode(self, messages: list[dict], images: list, videos: list = ()) -> EncodedPrompt:
        """`videos`: `load_video`'s clips."""
        inputs = self.task_encoder.encode_prompt(messages, images, list(videos))
        ids, positions = inputs.pop("input_ids"), inputs.pop("position_ids")
        return EncodedPrompt(ids, inputs, position_ids=positions)
