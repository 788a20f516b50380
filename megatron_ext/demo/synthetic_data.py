"""A synthetic LLaVA dataset for demos and tests: shapes in colours, with questions about them.

Writes ``OUT/images/NNNNNN.jpg`` (or .png) and ``OUT/llava.json`` in LLaVA's conversation format
(``[{"id", "image", "conversations": [{"from": "human"|"gpt", "value"}]}]``), single-turn and
multi-turn, in English or Japanese. Everything follows from the seed, and the answers follow from
the pictures, so a model can actually learn them.

With ``task="preference"`` it writes ``OUT/preference.json`` instead: the same pictures and
questions, each record's ``conversations`` ending with its last question, ``chosen`` the true
answer and ``rejected`` the answer about the picture with one fact wrong (the colour or the shape;
the place for a question about the place), for DPO.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from megatron_ext.data.tasks import PREFERENCE, SFT
from megatron_ext.fsutil import atomic_output_dir

COLORS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
          "purple": (140, 50, 170), "orange": (245, 140, 20)}
SHAPES = ("circle", "square", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
BACKGROUNDS = {"white": (250, 250, 250), "gray": (128, 128, 128), "black": (10, 10, 10)}

_JA = {
    "red": "赤", "green": "緑", "blue": "青", "yellow": "黄色", "purple": "紫", "orange": "オレンジ",
    "circle": "円", "square": "四角形", "triangle": "三角形",
    "top left": "左上", "top right": "右上", "bottom left": "左下", "bottom right": "右下",
    "white": "白", "gray": "灰色", "black": "黒",
}
QUESTIONS = {
    "en": {"shape": "What shape is in the image?", "color": "What color is the shape?",
           "place": "Where is the shape?", "describe": "Describe the image."},
    "ja": {"shape": "画像の図形は何ですか？", "color": "図形は何色ですか？",
           "place": "図形はどこにありますか？", "describe": "画像を説明してください。"},
}


@dataclass(frozen=True)
class SyntheticSpec:
    num_samples: int = 64
    multi_turn_fraction: float = 0.3
    min_size: int = 48  # image sides are drawn from [min_size, max_size]
    max_size: int = 96
    lang: str = "en"
    image_format: str = "jpg"  # "jpg" or "png"
    seed: int = 0
    task: str = SFT  # or PREFERENCE: chosen and rejected answers to the last question


def _answers(facts: dict, lang: str) -> dict:
    if lang == "ja":
        c, s, p, b = (_JA[facts[k]] for k in ("color", "shape", "place", "background"))
        return {"shape": f"{c}の{s}です。", "color": f"{c}です。", "place": f"{p}にあります。",
                "describe": f"{b}の背景の{p}に{c}の{s}があります。"}
    c, s, p, b = (facts[k] for k in ("color", "shape", "place", "background"))
    return {"shape": f"A {c} {s}.", "color": f"It is {c}.", "place": f"In the {p}.",
            "describe": f"A {c} {s} in the {p} of a {b} background."}


def draw(rng: random.Random, spec: SyntheticSpec) -> tuple[Image.Image, dict]:
    """One picture and the facts it shows (shape, color, place, background)."""
    facts = {"shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS)), "place": rng.choice(PLACES),
             "background": rng.choice(list(BACKGROUNDS))}
    w, h = rng.randint(spec.min_size, spec.max_size), rng.randint(spec.min_size, spec.max_size)
    image = Image.new("RGB", (w, h), BACKGROUNDS[facts["background"]])
    top, left = facts["place"].split()
    x0 = w // 16 if left == "left" else w // 2 + w // 16
    y0 = h // 16 if top == "top" else h // 2 + h // 16
    box = (x0, y0, x0 + w * 3 // 8, y0 + h * 3 // 8)
    pen = ImageDraw.Draw(image)
    fill = COLORS[facts["color"]]
    if facts["shape"] == "circle":
        pen.ellipse(box, fill=fill)
    elif facts["shape"] == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=fill)
    return image, facts


def conversation(facts: dict, multi_turn: bool, rng: random.Random, lang: str) -> tuple[list[dict], str]:
    """(LLaVA turns, the kind of question last asked)."""
    questions, answers = QUESTIONS[lang], _answers(facts, lang)
    kinds = rng.sample(list(questions), 3 if multi_turn else 1)
    first = f"<image>\n{questions[kinds[0]]}" if rng.random() < 0.5 else f"{questions[kinds[0]]}\n<image>"
    turns = []
    for i, kind in enumerate(kinds):
        turns.append({"from": "human", "value": first if i == 0 else questions[kind]})
        turns.append({"from": "gpt", "value": answers[kind]})
    return turns, kinds[-1]


# Facts a wrong answer to each kind of question gets wrong: a fact the answer states.
_WRONG_FACTS = {"shape": ("color", "shape"), "color": ("color",), "place": ("place",), "describe": ("color", "shape")}
_CHOICES = {"color": tuple(COLORS), "shape": SHAPES, "place": PLACES}


def rejected_answer(facts: dict, kind: str, rng: random.Random, lang: str) -> str:
    """A rejected answer to a `kind` question, of the two kinds preference sets hold: half the time the
    true answer with an object the picture does not show added (a hallucination, as POVID makes its
    rejected answers), else the answer about a picture whose colour, shape or place is another."""
    if rng.random() < 0.5:
        colour = rng.choice([c for c in COLORS if c != facts["color"]])
        shape, place = rng.choice(SHAPES), rng.choice([p for p in PLACES if p != facts["place"]])
        answer = _answers(facts, lang)[kind]
        if lang == "ja":
            return f"{answer}{_JA[place]}には{_JA[colour]}の{_JA[shape]}もあります。"
        return f"{answer} There is also a {colour} {shape} in the {place}."
    wrong = rng.choice(_WRONG_FACTS[kind])
    other = rng.choice([value for value in _CHOICES[wrong] if value != facts[wrong]])
    return _answers({**facts, wrong: other}, lang)[kind]


def _preference_record(record: dict, facts: dict, kind: str, rng: random.Random, lang: str) -> dict:
    *prompt, answer = record["conversations"]
    return {**record, "conversations": prompt, "chosen": answer["value"],
            "rejected": rejected_answer(facts, kind, rng, lang)}


def make_synthetic_dataset(out_dir: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Write the images and OUT/llava.json (OUT/preference.json for preference pairs); returns the JSON's path."""
    if spec.image_format not in ("jpg", "png"):
        raise ValueError(f"image_format must be jpg or png, not {spec.image_format!r}")
    if spec.task not in (SFT, PREFERENCE):
        raise ValueError(f"task must be {SFT} or {PREFERENCE}, not {spec.task!r}")
    rng = random.Random(spec.seed)
    # The wrong answers draw from a generator of their own: pictures and questions are the SFT set's of the same seed.
    wrong_rng = random.Random(f"rejected-{spec.seed}")
    name = "preference.json" if spec.task == PREFERENCE else "llava.json"
    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir) as tmp:
        (tmp / "images").mkdir()
        records = []
        for i in range(spec.num_samples):
            image, facts = draw(rng, spec)
            image_name = f"images/{i:06d}.{spec.image_format}"
            image.save(tmp / image_name, **({"quality": 95} if spec.image_format == "jpg" else {}))
            multi = rng.random() < spec.multi_turn_fraction
            turns, kind = conversation(facts, multi, rng, spec.lang)
            record = {"id": f"synthetic-{i:06d}", "image": image_name, "conversations": turns}
            if spec.task == PREFERENCE:
                record = _preference_record(record, facts, kind, wrong_rng, spec.lang)
            records.append(record)
        (tmp / name).write_text(json.dumps(records, ensure_ascii=False, indent=1))
    return out_dir / name
