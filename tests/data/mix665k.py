"""A small input shaped like LLaVA-1.5's llava_v1_5_mix665k.json, with the images it points to.

Nested image folders as mix665k has them (coco/, gqa/, ocr_vqa/, textvqa/, vg/); `<image>` before
or after the question; multi-turn conversations; text-only ShareGPT-style records (no "image");
multi-image records (LLaVA-Interleave's list of files); images in RGBA, palette, greyscale and
CMYK, a GIF, a 2 x 3 pixel one and a 2400 x 1800 one; and bad records of every kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

# id -> images the record has (0: text-only), for every record the builder must keep.
GOOD = {"coco-before": 1, "gqa-after": 1, "ocr-png": 1, "textvqa-palette": 1, "vg-cmyk": 1, "gif": 1, "tiny": 1,
        "large": 1, "multi-turn": 1, "sharegpt-1": 0, "sharegpt-2": 0, "interleave": 2, "interleave-3": 3,
        "no-marker": 1}
# reason -> how many of the bad records the builder reports with it.
BAD = {"missing image file": 1, "corrupt image": 1, "no gpt turn": 1, "empty answer": 1, "malformed record": 3,
       "number of <image> markers differs from the number of images": 2}


def _noise(size, mode="RGB", seed=0) -> Image.Image:
    rng = np.random.RandomState(seed)
    pixels = rng.randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _turns(*texts: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text} for i, text in enumerate(texts)]


def write_images(root: Path) -> dict[str, Path]:
    files = {
        "coco": root / "coco/train2017/000000033471.jpg",
        "gqa": root / "gqa/images/2354786.jpg",
        "ocr": root / "ocr_vqa/images/689852649.png",
        "palette": root / "textvqa/train_images/0a0bc91825468c45.png",
        "cmyk": root / "vg/VG_100K/2356347.jpg",
        "gif": root / "vg/VG_100K_2/2.gif",
        "tiny": root / "coco/train2017/tiny.png",
        "large": root / "coco/train2017/large.jpg",
        "corrupt": root / "coco/train2017/corrupt.jpg",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    _noise((64, 48)).save(files["coco"], "JPEG", quality=90)
    _noise((40, 60), "L", 1).save(files["gqa"], "JPEG")
    rgba = _noise((50, 30), "RGBA", 2)
    rgba.putalpha(Image.linear_gradient("L").resize((50, 30)))
    rgba.save(files["ocr"], "PNG")
    _noise((45, 45), "RGB", 3).convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(files["palette"], "PNG")
    _noise((52, 36), "CMYK", 4).save(files["cmyk"], "JPEG")
    _noise((30, 30), "RGB", 5).convert("P").save(files["gif"], "GIF")
    _noise((2, 3), "RGB", 6).save(files["tiny"], "PNG")
    Image.linear_gradient("L").resize((2400, 1800)).convert("RGB").save(files["large"], "JPEG")
    files["corrupt"].write_bytes(files["coco"].read_bytes()[:300])
    return files


def write_mix665k(root: Path) -> Path:
    """The JSON (root / "mix665k.json") and its images under root."""
    write_images(root)
    records = [
        {"id": "coco-before", "image": "coco/train2017/000000033471.jpg",
         "conversations": _turns("<image>\nWhat is in the picture?", "Noise in many colours.")},
        {"id": "gqa-after", "image": "gqa/images/2354786.jpg",
         "conversations": _turns("Is it grey?\n<image>", "Yes.")},
        {"id": "ocr-png", "image": "ocr_vqa/images/689852649.png",
         "conversations": _turns("<image>\nWho wrote this book?", "Nobody.", "What is its title?", "None.")},
        {"id": "textvqa-palette", "image": "textvqa/train_images/0a0bc91825468c45.png",
         "conversations": _turns("<image>\nWhat does the sign say?", "Nothing.")},
        {"id": "vg-cmyk", "image": "vg/VG_100K/2356347.jpg", "conversations": _turns("<image>\nColour?", "Mixed.")},
        {"id": "gif", "image": "vg/VG_100K_2/2.gif", "conversations": _turns("<image>\nA GIF?", "Yes.")},
        {"id": "tiny", "image": "coco/train2017/tiny.png", "conversations": _turns("<image>\nSize?", "Tiny.")},
        {"id": "large", "image": "coco/train2017/large.jpg",
         "conversations": _turns("<image>\nDescribe it.", "A gradient from black to white.")},
        {"id": "multi-turn", "image": "coco/train2017/000000033471.jpg",
         "conversations": _turns("<image>\nOne?", "1.", "Two?", "2.", "Three?", "3.")},
        {"id": "sharegpt-1", "model": "", "conversations": _turns("Write a haiku about rain.", "Rain on the roof.")},
        {"id": "sharegpt-2", "conversations": _turns("Hi!", "Hello.", "How are you?", "Fine, thanks.")},
        {"id": "interleave", "image": ["coco/train2017/000000033471.jpg", "ocr_vqa/images/689852649.png"],
         "conversations": _turns("<image>\n<image>\nWhat differs between the two images?", "The second is a book.")},
        {"id": "interleave-3", "image": ["gqa/images/2354786.jpg", "coco/train2017/tiny.png", "vg/VG_100K/2356347.jpg"],
         "conversations": _turns("Compare <image> with <image>.", "Same.", "And <image>?", "Different.")},
        {"id": "no-marker", "image": "coco/train2017/000000033471.jpg", "conversations": _turns("What?", "Noise.")},
        # Bad ones.
        {"id": "missing", "image": "coco/train2017/nowhere.jpg", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "corrupt", "image": "coco/train2017/corrupt.jpg", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "no-gpt", "image": "coco/train2017/000000033471.jpg", "conversations": _turns("<image>\nWhat?")},
        {"id": "empty", "conversations": _turns("What?", " ")},
        {"id": "marker-no-image", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "two-markers-one-image", "image": "coco/train2017/000000033471.jpg",
         "conversations": _turns("<image> and <image>?", "Red.")},
        {"id": "bad-image-field", "image": ["ok.jpg", 3], "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "bad-turn", "conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep"}]},
        "not a record",
    ]
    path = root / "mix665k.json"
    path.write_text(json.dumps(records, indent=1))
    return path
