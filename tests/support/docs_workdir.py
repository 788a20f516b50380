"""The working directory a reader of README.md and docs/ would have: every file and folder their
commands name, made of tiny artifacts (tests/test_docs_commands.py runs the commands in it).

`artifacts` builds the tiny things once: a LLaVA (text and vision with 8 heads, so that the docs'
--tp 4 and `plan --layouts 8x1,2x4` divide them) as HF and Megatron checkpoints, a LoRA run of one
iteration on it, 37 synthetic conversations and pairs (JSON, RLAIF-V JSONL) and a prepared dataset.
`workdir` lays out one directory per document: the names the docs use (`runs/stage2`, `ckpt/llava-tp4`,
`data/energon`, `cat.jpg`, `/data/...` as `data/...`) point at those artifacts.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.helpers import REPO_ROOT

# The docs' cluster paths (/data/llava665k/energon) stand for WORKDIR/data/...
CLUSTER_DATA = "/data/"
# What the docs name that lives in the repository.
FROM_REPO = ("scripts", "bench", "tests", "environments")
SAMPLES = 37


@dataclass(frozen=True)
class Artifacts:
    text: Path
    vision: Path
    llava_hf: Path
    megatron: Path
    lora_run: Path
    images: Path
    conversations: list[dict]  # LLaVA JSON records, images named relative to `images`
    pairs: list[dict]  # preference records, likewise
    dataset: Path


def _relative_images(records: list[dict]) -> list[dict]:
    return [{**r, "image": Path(r["image"]).name} for r in records]


def artifacts(root: Path) -> Artifacts:
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset
    from megatron_ext.demo.tiny_models import TinyTextSpec, TinyVisionSpec, make_text_model, make_vision_model
    from megatron_ext.hf.build_llava import build_llava
    from tests.support.training import train, trainer_args

    text = make_text_model(root / "text", TinyTextSpec(num_layers=4, num_heads=8, num_kv_heads=8))
    vision = make_vision_model(root / "vision", "clip", TinyVisionSpec(num_heads=8))
    llava_hf = build_llava(root / "llava-hf", str(text), str(vision))
    megatron = convert(llava_hf, root / "megatron", tp=1, pp=1)
    sft = make_synthetic_dataset(root / "sft", SyntheticSpec(num_samples=SAMPLES, seed=5))
    pairs = make_synthetic_dataset(root / "pairs", SyntheticSpec(num_samples=SAMPLES, seed=5, task="preference"))
    dataset = Path(build_energon_dataset(sft, root / "energon", num_workers=0).output_dir)
    lora_run = root / "lora-run"
    train(1, *trainer_args(megatron, dataset, lora_run, train_iters=1, lora_rank=4, lora_alpha=8.0))
    return Artifacts(text=text, vision=vision, llava_hf=llava_hf, megatron=megatron, lora_run=lora_run, images=sft.parent / "images",
                     conversations=_relative_images(json.loads(sft.read_text())),
                     pairs=_relative_images(json.loads(pairs.read_text())), dataset=dataset)


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cluster_paths(text: str, work: Path) -> str:
    """`text` with the docs' /data/... paths moved into `work`."""
    return re.sub(rf"(?<![\w./-]){re.escape(CLUSTER_DATA)}", f"{work}/data/", text)


def _blends(work: Path, made: Artifacts) -> None:
    """configs/blends/ with their /data paths in `work`, each member dataset the tiny one; blend.yaml
    (docs/data.md's) is llava15_mix_docs_text.yaml. /data/llava665k/energon is left for docs/data.md's
    recipe to build."""
    for source in sorted((REPO_ROOT / "configs" / "blends").glob("*.yaml")):
        _write(work / "configs" / "blends" / source.name, cluster_paths(source.read_text(), work))
        for line in source.read_text().splitlines():
            member = line.strip().removeprefix("path: ")
            if member.startswith(CLUSTER_DATA) and "llava665k" not in member:
                target = Path(cluster_paths(member, work))
                if not target.exists():
                    _link(target, made.dataset)
    shutil.copy(work / "configs" / "blends" / "llava15_mix_docs_text.yaml", work / "blend.yaml")


def workdir(work: Path, made: Artifacts, documented_files: dict[str, str]) -> Path:
    """`work` as the docs' reader has it; `documented_files`: files the docs show (path -> text)."""
    work.mkdir(parents=True)
    for name in FROM_REPO:
        _link(work / name, REPO_ROOT / name)
    links = {made.text: ["models/text"], made.vision: ["models/vision"], made.llava_hf: ["models/llava-hf", "hf/llava", "hf_out", "out/hf"],
             made.megatron: ["models/megatron", "ckpt/llava", "ckpt/llava-tp4", "ckpt/tiny", "runs/stage2",
                             "out/stage2"],
             made.lora_run: ["runs/lora"], made.dataset: ["data/energon", "data/tiny", "data/lcs558k/energon"],
             made.images: ["images", "data/llava-images", "data/textvqa/images"]}
    for target, names in links.items():
        for name in names:
            _link(work / name, target)
    shutil.copy(made.images / made.conversations[0]["image"], work / "cat.jpg")
    for sif in ("llava.sif", "demo.sif"):
        (work / sif).write_text("a container image\n")
    (work / "logs").mkdir()
    (work / "my-shards").mkdir()  # webdataset shards made outside the toolkit, not prepared yet
    for shard in made.dataset.glob("*.tar"):
        shutil.copy(shard, work / "my-shards")
    _write(work / "llava_v1_5_mix665k.json", json.dumps(made.conversations))
    _write(work / "pairs.json", json.dumps(made.pairs))
    rows = [{"image": r["image"], "question": r["conversations"][0]["value"].replace("<image>", "").strip(),
             "chosen": r["chosen"], "rejected": r["rejected"]} for r in made.pairs]
    _write(work / "rlaif_v.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    _write(work / "requests.jsonl", "".join(json.dumps({"id": str(i), "image": "cat.jpg", "prompt": prompt}) + "\n"
                                            for i, prompt in enumerate(["What is in the picture?", "Describe it."])))
    questions = [{"question_id": i, "image_path": str(work / "data/textvqa/images" / r["image"]),
                  "question": "what colour is the shape?", "answers": ["red"] * 10}
                 for i, r in enumerate(made.conversations[:2])]
    _write(work / "data/textvqa/val.jsonl", "".join(json.dumps(q) + "\n" for q in questions))
    _blends(work, made)
    for path, text in documented_files.items():
        _write(work / path, cluster_paths(text, work))
    return work
