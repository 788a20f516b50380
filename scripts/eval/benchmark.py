"""Score a Megatron or Hugging Face LLaVA checkpoint on lmms-eval tasks (needs the `eval` extra).

    python scripts/eval/benchmark.py --hf-dir D --tasks textvqa_val,scienceqa_img --output-dir OUT [--limit 100]
    python scripts/eval/benchmark.py --megatron-dir D --tp 2 --tasks textvqa_val --output-dir OUT  (starts its 2 ranks)
    python scripts/eval/benchmark.py --hf-dir D --include-path my_tasks/ --tasks my_vqa --output-dir OUT

Writes lmms-eval's result file and per-sample logs and OUT/summary.json, and prints a table.
"""

from megatron_ext.commands.eval import benchmark
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(benchmark)
