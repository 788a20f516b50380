"""Evaluate a Megatron or Hugging Face LLaVA checkpoint on a prepared dataset's val or test split.

    python scripts/eval/evaluate.py --megatron-dir D --data-path DATA --output-dir OUT [--split test] [--fast-n 50]
    torchrun --nproc-per-node 2 scripts/eval/evaluate.py --megatron-dir D --tp 2 --data-path DATA --output-dir OUT

Writes OUT/predictions.jsonl (one generated answer per sample) and OUT/metrics.json (loss and
perplexity for Megatron checkpoints; exact match, BLEU, ROUGE-L and CIDEr), and prints a table.
"""

from megatron_ext.commands.eval import evaluate
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(evaluate)
