"""Input records of the dataset builder, turned into webdataset samples or a reason to skip them.

Inputs:
- LLaVA conversation JSON: a list of ``{"id", "image", "conversations": [{"from", "value"}]}``
  (LLaVA-Pretrain, LLaVA-Instruct-150K, LLaVA-1.5's mix665k). ``"image"`` is one file, a list of
  files (LLaVA-Interleave, OneVision: one ``<image>`` per file, in order), or absent for a
  text-only conversation (mix665k's ShareGPT part);
- JSONL (``.jsonl``): one ``{"image", "question", "answer"}`` per line, ``image`` likewise.

A record may name one video, ``"video": "clip.mp4"`` (LLaVA-OneVision's and LLaVA-Video's JSON),
marked ``<video>`` in the text; the ``<image>`` those datasets mark it with is read as ``<video>``
when the record has no image. Its file is stored as it is, once PyAV decodes it (`data.video`).

Each usable record becomes one sample in the layout of `shard_format`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.data.conversation import (
    MALFORMED,
    BadConversation,
    image_files,
    llava_messages,
    place_images,
    place_videos,
    qa_messages,
    video_files,
    video_marked_as_image,
)
from megatron_ext.data.shard_format import ImageFileError, image_file_part, image_part_names, video_part_name
from megatron_ext.errors import UserError

LLAVA, JSONL = "llava", "jsonl"
MISSING_IMAGE = "missing image file"
CORRUPT_IMAGE = "corrupt image"
MISSING_VIDEO = "missing video file"
CORRUPT_VIDEO = "video cannot be decoded"


@dataclass(frozen=True)
class Skip:
    index: int
    id: str
    reason: str
    detail: str = ""

    def describe(self) -> str:
        return f"sample {self.index} (id {self.id}): {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class ShardSample:
    parts: dict  # webdataset sample: __key__ and its parts
    num_images: int
    num_videos: int = 0


def read_records(path: Path) -> tuple[str, list]:
    """(input kind, records): dicts, or for unparsable JSONL lines the error text."""
    if not path.is_file():
        raise UserError(f"INPUT {path} does not exist")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                records.append(f"line {number} is not JSON: {exc}")
        return JSONL, records
    try:
        records = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"INPUT {path} is not valid JSON ({exc}); JSONL input must end in .jsonl") from exc
    if not isinstance(records, list):
        raise UserError(
            f"INPUT {path} holds a JSON {type(records).__name__}, not a list of LLaVA samples "
            '([{"id", "image", "conversations": [...]}, ...])'
        )
    return LLAVA, records


def _messages(kind: str, record: dict) -> tuple[list[dict], list | None]:
    """(chat messages, the LLaVA turns when they are more than one question and its answer)."""
    if kind == JSONL:
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise BadConversation(MALFORMED, "needs string 'question' and 'answer'")
        return qa_messages(question, answer), None
    turns = record.get("conversations")
    messages = llava_messages(turns)
    if not any(m["role"] == "user" for m in messages):
        raise BadConversation(MALFORMED, "no human turn")
    multi = len(messages) > 2 or messages[0]["role"] != "user"
    return messages, turns if multi else None


def video_file_part(path: Path) -> tuple[str, bytes]:
    """(part name, bytes) of a video file as it is stored; checks that PyAV decodes it."""
    from megatron_ext.data.video import read_frames

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadConversation(MISSING_VIDEO, f"{path}: {exc.strerror}") from None
    try:
        read_frames(data, 1, name=str(path))
    except UserError as exc:
        raise BadConversation(CORRUPT_VIDEO, str(exc)) from None
    return video_part_name(path), data


def shard_sample(kind: str, image_root: Path, item: tuple[int, object]) -> ShardSample | Skip:
    """The webdataset sample for record `item` = (index, record), or a Skip."""
    index, record = item
    if not isinstance(record, dict):
        detail = record if isinstance(record, str) else f"expected an object, got {type(record).__name__}"
        return Skip(index, "?", MALFORMED, detail)
    sample_id = str(record.get("id", index))
    try:
        messages, turns = _messages(kind, record)
        files, video_names = image_files(record), video_files(record)
        if len(video_names) > 1:  # a shard sample holds one video part
            raise BadConversation(MALFORMED, "'video' must be one file name")
        if video_names:
            messages, turns = video_marked_as_image(messages, turns, len(files))
        place_videos(place_images(messages, len(files)), len(video_names))
        images = [image_file_part(image_root / name) for name in files]
        videos = [video_file_part(image_root / name) for name in video_names]
    except BadConversation as exc:
        return Skip(index, sample_id, exc.reason, exc.detail)
    except ImageFileError as exc:
        return Skip(index, sample_id, MISSING_IMAGE if exc.missing else CORRUPT_IMAGE, str(exc))
    meta = {"question": next(m["content"] for m in messages if m["role"] == "user"), "id": sample_id}
    if turns is not None:
        meta["conversations"] = turns
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    parts = {"__key__": f"{index:09d}", "txt": answer, "json": json.dumps(meta, ensure_ascii=False)}
    parts.update(zip(image_part_names([ext for ext, _ in images]), (data for _, data in images)))
    parts.update(videos)
    return ShardSample(parts, len(images), len(videos))
