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

Preference pairs (``--task preference``, for DPO) come in any of three shapes, told apart per record:
- LLaVA turns: ``conversations`` whose last gpt turn is the chosen answer and
  ``rejected_conversations``, the same turns with the rejected answer last (POVID); or
  ``conversations`` ending with the human turn (or with the chosen answer) plus string fields
  ``chosen`` and ``rejected``; ``image`` and ``video`` as above;
- RLAIF-V rows: ``image``, ``question``, ``chosen``, ``rejected``;
- TRL's conversational rows: ``prompt`` (chat messages whose content is a string or a list of
  ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts), ``chosen`` and ``rejected`` (one
  assistant message each, or strings), ``images`` (file names, one per image part).
Each becomes one sample holding the images once and the prompt, chosen and rejected texts.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.data.conversation import (
    EMPTY_ANSWER,
    IMAGE_MARKER,
    MALFORMED,
    VIDEO_MARKER,
    BadConversation,
    count_markers,
    file_names,
    image_files,
    llava_messages,
    llava_turns,
    place_images,
    place_videos,
    qa_messages,
    turn_messages,
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
MISSING_REJECTED = "missing rejected answer"
SAME_ANSWERS = "chosen equals rejected"
PROMPT_TOO_LONG = "prompt over the length"


@dataclass(frozen=True)
class Skip:
    index: int
    id: str
    reason: str
    detail: str = ""

    def describe(self, unit: str = "sample") -> str:
        return f"{unit} {self.index} (id {self.id}): {self.reason}" + (f" ({self.detail})" if self.detail else "")


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


def _media_parts(image_root: Path, files: list[str], video_names: list[str]) -> dict:
    """The shard parts of a sample's images and video; raises ImageFileError or BadConversation."""
    images = [image_file_part(image_root / name) for name in files]
    parts = dict(zip(image_part_names([ext for ext, _ in images]), (data for _, data in images)))
    parts.update(video_file_part(image_root / name) for name in video_names)
    return parts


def _marked(messages: list[dict], turns, num_images: int, video_names: list[str]):
    """(messages, turns) with LLaVA-Video's marker rewritten, and the messages with one marker per
    image and video placed; raises BadConversation when they cannot be."""
    if len(video_names) > 1:  # a shard sample holds one video part
        raise BadConversation(MALFORMED, "'video' must be one file name")
    if video_names:
        messages, turns = video_marked_as_image(messages, turns, num_images)
    return messages, turns, place_videos(place_images(messages, num_images), len(video_names))


def _sample_or_skip(make, item: tuple[int, object]) -> ShardSample | Skip:
    """`make(key, id, record)` for record `item` = (index, record), or a Skip with its reason."""
    index, record = item
    if not isinstance(record, dict):
        detail = record if isinstance(record, str) else f"expected an object, got {type(record).__name__}"
        return Skip(index, "?", MALFORMED, detail)
    sample_id = str(record.get("id", index))
    try:
        return make(f"{index:09d}", sample_id, record)
    except BadConversation as exc:
        return Skip(index, sample_id, exc.reason, exc.detail)
    except ImageFileError as exc:
        return Skip(index, sample_id, MISSING_IMAGE if exc.missing else CORRUPT_IMAGE, str(exc))


def _sft_sample(kind: str, image_root: Path, key: str, sample_id: str, record: dict) -> ShardSample:
    messages, turns = _messages(kind, record)
    files, video_names = image_files(record), video_files(record)
    # The markers are placed again on reading: the text is stored as the record has it.
    messages, turns, _ = _marked(messages, turns, len(files), video_names)
    media = _media_parts(image_root, files, video_names)
    meta = {"question": next(m["content"] for m in messages if m["role"] == "user"), "id": sample_id}
    if turns is not None:
        meta["conversations"] = turns
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    parts = {"__key__": key, "txt": answer, "json": json.dumps(meta, ensure_ascii=False), **media}
    return ShardSample(parts, len(files), len(video_names))


def shard_sample(kind: str, image_root: Path, item: tuple[int, object]) -> ShardSample | Skip:
    """The webdataset sample (SFT) for record `item` = (index, record), or a Skip."""
    return _sample_or_skip(functools.partial(_sft_sample, kind, image_root), item)


@functools.cache
def _tokenizer(path: str):
    from megatron_ext.hf_loading import load_tokenizer

    return load_tokenizer(path, "--tokenizer-load-dir")


@dataclass(frozen=True)
class PromptLimit:
    """--tokenizer-load-dir / --seq-length: a pair whose prompt alone reaches `seq_length` tokens
    leaves no room for an answer. A rough count: the prompt texts' tokens without a chat template,
    plus one token per image or video."""

    tokenizer_dir: str
    seq_length: int

    def load(self) -> None:
        """Loads the tokenizer (a UserError if it cannot be), so forked workers inherit it."""
        _tokenizer(self.tokenizer_dir)

    def check(self, prompt: list[dict]) -> None:
        tokenizer = _tokenizer(self.tokenizer_dir)
        media = count_markers(prompt) + count_markers(prompt, VIDEO_MARKER)
        text = "\n".join(m["content"] for m in prompt).replace(IMAGE_MARKER, "").replace(VIDEO_MARKER, "")
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + media
        if tokens >= self.seq_length:
            raise BadConversation(PROMPT_TOO_LONG, f"{tokens} prompt tokens, --seq-length {self.seq_length}")


def _split_answer(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(the turns before the final gpt turn, its text), or (all turns, None) when they end otherwise."""
    if messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None


def _llava_pair(record: dict) -> tuple[list[dict], object, object]:
    prompt, answer = _split_answer(turn_messages(record["conversations"]))
    if "rejected_conversations" in record:
        rejected = None
        if record["rejected_conversations"] not in (None, []):
            rejected_prompt, rejected = _split_answer(turn_messages(record["rejected_conversations"], "rejected_conversations"))
            if rejected_prompt != prompt:
                raise BadConversation(MALFORMED, "'rejected_conversations' asks other than 'conversations'")
        return prompt, answer, rejected
    chosen = record.get("chosen", answer)
    if answer is not None and chosen != answer:
        raise BadConversation(MALFORMED, "'chosen' differs from the last gpt turn of 'conversations'")
    return prompt, chosen, record.get("rejected")


def _trl_content(content) -> str:
    """A TRL message's content as text: text parts as they are, image parts as `<image>`, one per line."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadConversation(MALFORMED, "a message's 'content' must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            texts.append(IMAGE_MARKER)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise BadConversation(MALFORMED, f"content part {part!r} is neither text nor an image")
    return "\n".join(texts)


def _trl_messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadConversation(MALFORMED, f"'{key}' must be a string or a non-empty list of messages")
    messages = []
    for message in value:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise BadConversation(MALFORMED, f"message {message!r} in '{key}' needs a 'role' (system/user/assistant)")
        messages.append({"role": message["role"], "content": _trl_content(message.get("content"))})
    return messages


def _trl_answer(value, key: str):
    """The text of TRL's `chosen` / `rejected` (one assistant message, or a string); None when absent."""
    if value in (None, "", []) or isinstance(value, str):
        return value or None
    messages = _trl_messages(value, key)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise BadConversation(MALFORMED, f"'{key}' must hold one assistant message")
    return messages[0]["content"]


def _trl_pair(record: dict) -> tuple[list[dict], object, object]:
    prompt = record["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _trl_messages(prompt, "prompt")
    return prompt, _trl_answer(record.get("chosen"), "chosen"), _trl_answer(record.get("rejected"), "rejected")


def preference_pair(record: dict) -> tuple[list[dict], str, str, list[str]]:
    """(prompt messages ending with the user turn that is answered, chosen, rejected, image files) of
    a record in any of the three shapes; raises BadConversation for a pair that cannot be used."""
    if "conversations" in record:
        (prompt, chosen, rejected), files = _llava_pair(record), image_files(record)
    elif "prompt" in record:
        (prompt, chosen, rejected), files = _trl_pair(record), file_names(record, "images")
    elif "question" in record:
        if not isinstance(record["question"], str):
            raise BadConversation(MALFORMED, "'question' must be a string")
        prompt, chosen, rejected = [{"role": "user", "content": record["question"]}], record.get("chosen"), record.get("rejected")
        files = image_files(record)
    else:
        raise BadConversation(MALFORMED, "needs 'conversations', 'prompt' or 'question'")
    if not prompt or prompt[-1]["role"] != "user":
        raise BadConversation(MALFORMED, "the prompt must end with the human turn that is answered")
    if not isinstance(chosen, str):
        raise BadConversation(MALFORMED, "no string 'chosen' answer")
    if not chosen.strip():
        raise BadConversation(EMPTY_ANSWER, "'chosen'")
    if rejected is None or isinstance(rejected, str) and not rejected.strip():
        raise BadConversation(MISSING_REJECTED)
    if not isinstance(rejected, str):
        raise BadConversation(MALFORMED, "'rejected' must be a string")
    if chosen.strip() == rejected.strip():
        raise BadConversation(SAME_ANSWERS)
    return prompt, chosen, rejected, files


def _preference_sample(limit: PromptLimit | None, image_root: Path, key: str, sample_id: str, record: dict) -> ShardSample:
    prompt, chosen, rejected, files = preference_pair(record)
    video_names = video_files(record)
    _, _, prompt = _marked(prompt, None, len(files), video_names)
    if limit is not None:  # before the media are read: the cheaper check first
        limit.check(prompt)
    media = _media_parts(image_root, files, video_names)
    meta = {"id": sample_id, "conversations": llava_turns(prompt), "chosen": chosen, "rejected": rejected}
    parts = {"__key__": key, "json": json.dumps(meta, ensure_ascii=False), **media}
    return ShardSample(parts, len(files), len(video_names))


def preference_sample(limit: PromptLimit | None, image_root: Path, item: tuple[int, object]) -> ShardSample | Skip:
    """The webdataset sample (a preference pair) for record `item` = (index, record), or a Skip;
    `limit` skips pairs whose prompt is too long."""
    return _sample_or_skip(functools.partial(_preference_sample, limit, image_root), item)
