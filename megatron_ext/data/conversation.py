"""Conversations as chat messages, checked once for the dataset builder and the task encoder.

A sample's conversation arrives either as LLaVA turns (``[{"from": "human"|"gpt"|"system",
"value": ...}]``, the ``conversations`` of LLaVA-Pretrain / LLaVA-Instruct) or as one question and
one answer (JSONL input, or shards laid out as in the original README). Both become HF chat
messages ``[{"role": "system"|"user"|"assistant", "content": str}]`` with the literal ``<image>``
marking where each image goes.
"""

from __future__ import annotations

from megatron_ext.families.llava import IMAGE_TOKEN as IMAGE_MARKER
from megatron_ext.families.llava import VIDEO_TOKEN as VIDEO_MARKER

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
LLAVA_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}

# Reasons a sample cannot be trained on (the builder's report groups skipped samples by these).
NO_ANSWER = "no gpt turn"
EMPTY_ANSWER = "empty answer"
MALFORMED = "malformed record"
IMAGE_COUNT = "number of <image> markers differs from the number of images"
VIDEO_COUNT = "number of <video> markers differs from the number of videos"


class BadConversation(ValueError):
    """A conversation that cannot be trained on; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def llava_messages(turns) -> list[dict]:
    """Chat messages from LLaVA turns; raises BadConversation for anything untrainable."""
    messages = turn_messages(turns)
    check_answers(messages)
    return messages


def turn_messages(turns, key: str = "conversations") -> list[dict]:
    """Chat messages from LLaVA turns (record field `key`), answered or not; raises BadConversation
    for turns that are not LLaVA's."""
    if not isinstance(turns, list) or not turns:
        raise BadConversation(MALFORMED, f"'{key}' must be a non-empty list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("from") not in ROLES or not isinstance(turn.get("value"), str):
            raise BadConversation(MALFORMED, f"turn {turn!r} needs 'from' (human/gpt/system) and a string 'value'")
        messages.append({"role": ROLES[turn["from"]], "content": turn["value"]})
    return messages


def llava_turns(messages: list[dict]) -> list[dict]:
    """LLaVA turns of chat messages (the inverse of `turn_messages`)."""
    return [{"from": LLAVA_ROLES[m["role"]], "value": m["content"]} for m in messages]


def qa_messages(question: str, answer: str) -> list[dict]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    check_answers(messages)
    return messages


def check_answers(messages: list[dict]) -> None:
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if not answers:
        raise BadConversation(NO_ANSWER)
    if any(not a.strip() for a in answers):
        raise BadConversation(EMPTY_ANSWER)


def file_names(record: dict, key: str) -> list[str]:
    """A record's `key`: absent, one file name, or a list of them."""
    value = record.get(key)
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(name, str) and name for name in value):
        return value
    raise BadConversation(MALFORMED, f"'{key}' must be a file name or a list of file names")


def image_files(record: dict) -> list[str]:
    """A record's `"image"`: absent (no image), one file name, or a list of them (LLaVA-Interleave)."""
    return file_names(record, "image")


def video_files(record: dict) -> list[str]:
    """A record's `"video"` (LLaVA-OneVision / LLaVA-Video): absent, one file name, or a list of them."""
    return file_names(record, "video")


def video_marked_as_image(messages: list[dict], turns, num_images: int):
    """(messages, turns) with LLaVA-Video's marker rewritten: its JSON marks a sample's one video
    with `<image>`; a sample without images and `<video>` markers gets `<video>` there instead."""
    if num_images or count_markers(messages, VIDEO_MARKER) or count_markers(messages) != 1:
        return messages, turns
    messages = [{**m, "content": m["content"].replace(IMAGE_MARKER, VIDEO_MARKER)} for m in messages]
    if turns is not None:
        turns = [{**t, "value": t["value"].replace(IMAGE_MARKER, VIDEO_MARKER)} for t in turns]
    return messages, turns


def count_markers(messages: list[dict], marker: str = IMAGE_MARKER) -> int:
    return sum(m["content"].count(marker) for m in messages if m["role"] != "assistant")


def place_images(messages: list[dict], num_images: int, marker: str = IMAGE_MARKER) -> list[dict]:
    """Messages with one `<image>` (`marker`) per image: kept where the text has them, otherwise
    put at the start of the first user turn (LLaVA's "<image>\\n question" layout)."""
    markers = count_markers(messages, marker)
    if markers == 0 and num_images:
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            raise BadConversation(MALFORMED, "no user turn to put the image in")
        messages = [dict(m) for m in messages]
        messages[first_user]["content"] = (marker + "\n") * num_images + messages[first_user]["content"]
    elif markers != num_images:
        raise BadConversation(IMAGE_COUNT if marker == IMAGE_MARKER else VIDEO_COUNT,
                              f"{markers} markers, {num_images} {'images' if marker == IMAGE_MARKER else 'videos'}")
    return messages


def place_videos(messages: list[dict], num_videos: int) -> list[dict]:
    """Messages with one `<video>` per video, as `place_images` places images."""
    return place_images(messages, num_videos, VIDEO_MARKER)


def sample_messages(context, answers) -> list[dict]:
    """Messages of a decoded VQASample: `context` is LLaVA turns (multi-turn samples) or the
    question string; `answers` the answer string (or a list whose first item is the answer)."""
    if isinstance(context, list):
        return llava_messages(context)
    if isinstance(answers, (list, tuple)):
        answers = answers[0] if answers else ""
    if not isinstance(context, str) or not isinstance(answers, str):
        raise BadConversation(MALFORMED, "expected a question string and an answer string")
    return qa_messages(context, answers)
