"""Local lmms-eval tasks on tiny images, shaped like the standard ones and scored by lmms-eval's own
functions: VQA accuracy over 10 reference answers (TextVQA's), multiple choice (ScienceQA-IMG's),
captioning (COCO's CIDEr), and VQA about a video file (lmms-eval sends a path that is not an image's
as a video). Written as a user with no Hub access writes them (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

UTILS = '''
from PIL import Image

from lmms_eval.tasks.coco_cap.utils import coco_cider, coco_process_result
from lmms_eval.tasks.scienceqa.utils import sqa_doc_to_text, sqa_process_results
from lmms_eval.tasks.textvqa.utils import textvqa_process_results


def doc_to_visual(doc):
    if doc.get("video_path"):  # a JSON task whose other documents have one gives this one None
        return [doc["video_path"]]
    return [Image.open(doc["image_path"]).convert("RGB")]


def vqa_doc_to_text(doc):
    return doc["question"] + "\\nAnswer the question using a single word or phrase."


def caption_doc_to_text(doc):
    return "Provide a one-sentence caption for the provided image."
'''

_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  temperature: 0
  do_sample: false
  until:
    - "ASSISTANT:"
"""

TASKS = {
    "tiny_vqa": """doc_to_text: !function utils.vqa_doc_to_text
doc_to_target: answers
process_results: !function utils.textvqa_process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
    "tiny_mc": """doc_to_text: !function utils.sqa_doc_to_text
doc_to_target: answer
process_results: !function utils.sqa_process_results
lmms_eval_specific_kwargs:
  default:
    format: default
    pre_prompt: ""
    post_prompt: "\\nAnswer with the option's letter from the given choices directly."
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
    "tiny_video": """doc_to_text: !function utils.vqa_doc_to_text
doc_to_target: answers
process_results: !function utils.textvqa_process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
    "tiny_caption": """doc_to_text: !function utils.caption_doc_to_text
doc_to_target: answer
process_results: !function utils.coco_process_result
metric_list:
  - metric: coco_CIDEr
    aggregation: !function utils.coco_cider
    higher_is_better: true
""",
}


def write_tasks(root: Path, docs: dict[str, list[dict]], max_new_tokens: int) -> Path:
    """ROOT/<task>.yaml, ROOT/<task>.jsonl for each task in `docs`, and ROOT/utils.py."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "utils.py").write_text(UTILS)
    for task, records in docs.items():
        data = root / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        (root / f"{task}.yaml").write_text(f"task: {task}\n" + _COMMON.format(data=data, max_new_tokens=max_new_tokens)
                                           + TASKS[task])
    return root
