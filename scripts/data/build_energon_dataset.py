"""Build a prepared megatron-energon dataset from LLaVA conversation JSON or question/answer JSONL.

    python scripts/data/build_energon_dataset.py INPUT --output-dir OUT [--image-root DIR]
        [--split-ratio 9,1,0] [--samples-per-shard N] [--num-workers N] [--strict]
        [--task sft|preference] [--tokenizer-load-dir DIR --seq-length N]

INPUT is LLaVA JSON (a list of {"id", "image", "conversations": [{"from": "human"|"gpt", "value"}]};
"image" one file, a list of files with one <image> each, or absent for a text-only conversation) or
a .jsonl file of {"image", "question", "answer"} lines; image paths are relative to --image-root
(default: INPUT's folder). OUT gets NNNNNN.tar shards (KEY.jpg or KEY.png, KEY.0.jpg ... for several
images, KEY.txt, KEY.json), is prepared with `energon prepare`, and lists skipped samples in
OUT/build_report.json. OUT appears only when everything succeeded.

--task preference reads preference pairs for DPO instead (see megatron_ext/data/sources.py for the
three record shapes) and writes each with its images once and KEY.json {"id", "conversations" (the
prompt), "chosen", "rejected"}.
"""

from megatron_ext.commands.data import build
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(build)
