"""Small sample inputs of the data tests: a JPEG of one colour, a LLaVA JSON's records by the keys the
builder gives them."""

from __future__ import annotations

import io
import json
from pathlib import Path


def records_by_key(json_path: Path) -> dict[str, dict]:
    """The builder keys sample i of the input as f"{i:09d}"."""
    return {f"{i:09d}": r for i, r in enumerate(json.loads(json_path.read_text()))}


def jpeg(color=(200, 30, 30), size=(40, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "JPEG")
    return out.getvalue()
