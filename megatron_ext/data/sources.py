"""Input records of the dataset builder, turned into webdataset samples or a reason to skip them.

Inputs:
- LLaVA conversation JSON: a list of ``{"id", "image", "conversations": [{"from", "value"}]}``
  with ``<image>`` in a human turn (LLaVA-Pretrain, LLaVA-Instruct-150K);
- JSONL (``.jsonl``): one ``{"image", "question", "answer"}`` per line.

Each usable record becomes the original README's layout: ``KEY.jpg`` (the image; re-encoded only
when it is not a JPEG), ``KEY.txt`` (the first answer) and ``KEY.json`` (``{"question", "id"}``,
plus ``"conversations"`` with every turn when there is more than one exchange).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.data.conversation import (
    IMAGE_COUNT,
    MALFORMED,
    NO_IMAGE_MARKER,
    BadConversation,
    count_image_markers,
    llava_messages,
    qa_messages,
)
from megatron_ext.errors import UserError

LLAVA, JSONL = "llava", "jsonl"
NO_IMAGE = "no image given"
MISSING_IMAGE = "missing image file"
CORRUPT_IMAGE = "corrupt image"
JPEG_QUALITY = 95


@dataclass(frozen=True)
class Skip:
    index: int
    id: str
    reason: str
    detail: str = ""

    def describe(self) -> str:
        return f"sample {self.index} (id {self.id}): {self.reason}" + (f" ({self.detail})" if self.detail else "")


class _BadImage(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


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


def _conversation(kind: str, record: dict) -> tuple[str, str, list | None]:
    """(first question, first answer, all turns when there are several exchanges)."""
    if kind == JSONL:
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise BadConversation(MALFORMED, "needs string 'question' and 'answer'")
        messages = qa_messages(question, answer)
        if count_image_markers(messages) > 1:
            raise BadConversation(IMAGE_COUNT, "at most one <image> per question")
        return question, answer, None
    turns = record.get("conversations")
    messages = llava_messages(turns)
    markers = count_image_markers(messages)
    if markers == 0:
        raise BadConversation(NO_IMAGE_MARKER)
    if markers > 1:
        raise BadConversation(IMAGE_COUNT, f"{markers} markers for one image")
    question = next((m["content"] for m in messages if m["role"] == "user"), None)
    if question is None:
        raise BadConversation(MALFORMED, "no human turn")
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    multi = len(messages) > 2 or messages[0]["role"] != "user"
    return question, answer, turns if multi else None


def jpeg_bytes(path: Path) -> bytes:
    """The file's bytes when it is a JPEG, else the image re-encoded as JPEG; checks it decodes."""
    from PIL import Image

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _BadImage(MISSING_IMAGE, str(path)) from None
    except OSError as exc:
        raise _BadImage(MISSING_IMAGE, f"{path}: {exc.strerror}") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format == "JPEG":
                return data
            out = io.BytesIO()
            image.convert("RGB").save(out, "JPEG", quality=JPEG_QUALITY)
            return out.getvalue()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _BadImage(CORRUPT_IMAGE, f"{path}: {exc}") from None


def shard_sample(kind: str, image_root: Path, item: tuple[int, object]) -> dict | Skip:
    """A webdataset sample (key, jpg, txt, json) for record `item` = (index, record), or a Skip."""
    index, record = item
    if not isinstance(record, dict):
        detail = record if isinstance(record, str) else f"expected an object, got {type(record).__name__}"
        return Skip(index, "?", MALFORMED, detail)
    sample_id = str(record.get("id", index))
    try:
        question, answer, turns = _conversation(kind, record)
        if not isinstance(record.get("image"), str) or not record["image"]:
            return Skip(index, sample_id, NO_IMAGE)
        image = jpeg_bytes(image_root / record["image"])
    except BadConversation as exc:
        return Skip(index, sample_id, exc.reason, exc.detail)
    except _BadImage as exc:
        return Skip(index, sample_id, exc.reason, str(exc))
    meta = {"question": question, "id": sample_id}
    if turns is not None:
        meta["conversations"] = turns
    return {"__key__": f"{index:09d}", "jpg": image, "txt": answer,
            "json": json.dumps(meta, ensure_ascii=False)}
