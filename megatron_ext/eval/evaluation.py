"""Evaluate a checkpoint on a prepared dataset's val or test split.

- Loss and perplexity (Megatron checkpoints): the trainer's own task encoder (chat template,
  masks, truncation) and the trainer's own forward step and token-weighted loss reduction
  (`megatron_ext.model.forward_step`), so the number is the one the trainer logs as validation loss.
  HF checkpoints get generation metrics only (convert them to Megatron for loss and perplexity).
- Generated answers to the last user turn of each sample, scored against the sample's last
  assistant turn with `megatron_ext.eval.answer_scores`.

`AnswerEvaluation` is the same generation + scoring on the trainer's model inside its process
group, for the trainer to run at --eval-interval.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from megatron_ext.errors import UserError
from megatron_ext.eval import answer_scores
from megatron_ext.eval.checkpoints import ModelSource
from megatron_ext.eval.generation import Generator
from megatron_ext.eval.prompts import PromptEncoder
from megatron_ext.eval.samples import EvalSample, read_samples
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.progress import progress

log = logging.getLogger(__name__)

PREDICTIONS_FILE = "predictions.jsonl"
METRICS_FILE = "metrics.json"


def answer_samples(generator: Generator, encoder: PromptEncoder, samples: list[EvalSample],
                   options: SamplingOptions) -> list[dict]:
    """One prediction record per sample (collective for Megatron generators); samples whose prompt
    does not fit in the context are recorded with the reason (`too_long`) instead of a prediction."""
    records = []
    for sample in progress(samples, desc="answering", unit="sample"):
        record = {"key": sample.key, "question": sample.question, "reference": sample.reference}
        prompt = encoder.encode(sample.messages, sample.images)
        try:
            generation = generator.generate(prompt, options)
        except UserError as exc:
            records.append({**record, "too_long": str(exc)})
            continue
        records.append({**record, "prediction": generation.text, "finish_reason": generation.finish_reason,
                        "exact_match": answer_scores.exact_match([generation.text], [[sample.reference]]) == 1.0})
    return records


def score_records(records: list[dict]) -> dict:
    answered = [r for r in records if "prediction" in r]
    scores = answer_scores.score_all([r["prediction"] for r in answered], [[r["reference"]] for r in answered])
    return {**scores, "generated_samples": len(answered), "too_long_samples": len(records) - len(answered)}


class TrainerPrompts:
    """How the trainer's evaluations prompt its model: as scripts/eval prompts a checkpoint of its arch
    (`checkpoints.prompt_encoding`), with the run's chat template, language and aspect mode."""

    def __init__(self, plan):
        from megatron_ext.eval.checkpoints import prompt_encoding

        cfg = plan.config
        prompts = prompt_encoding(plan.tokenizer_dir, "--tokenizer-load-dir", plan.hf_config, plan.arch,
                                  cfg.chat_template, cfg.lang, cfg.image_aspect, (cfg.min_pixels, cfg.max_pixels))
        self.processor, self.encoder = prompts["processor"], prompts["encoder"]
        self.arch = plan.arch

    def generator(self, model):
        """A generator over this rank's bare model (`TrainingModel.model`), collective."""
        from megatron_ext.eval.checkpoints import megatron_generator

        return megatron_generator(model, self.arch, self.processor)


class AnswerEvaluation:
    """--eval-generate-samples N: the trainer's model answers the first N val samples greedily at every
    evaluation, scored as scripts/eval/evaluate.py scores them, with the trainer's chat template."""

    def __init__(self, plan):
        cfg = plan.config
        self.samples = read_samples(cfg.data_path, "val", limit=cfg.eval_generate_samples)
        self.prompts = TrainerPrompts(plan)
        self.options = SamplingOptions(max_new_tokens=cfg.eval_max_new_tokens)

    def run(self, model) -> tuple[dict, list[dict]]:
        """(scores, prediction records); collective over the whole world, the same on every rank.
        `model`: this rank's bare LLaVAModel (`TrainingModel.model`) in any TP x PP x DP layout;
        data-parallel replicas split the samples. The model is put in eval mode and back."""
        from megatron_ext.distributed import split_over_data_parallel

        generator = self.prompts.generator(model)
        records = split_over_data_parallel(
            self.samples, lambda mine: answer_samples(generator, self.prompts.encoder, mine, self.options))
        return score_records(records), records


def megatron_loss(model, source: ModelSource, data_path: str, split: str, limit: int | None,
                  seq_length: int) -> tuple[float, int]:
    """Token-weighted mean loss over the split's first `limit` samples (collective)."""
    from megatron.energon import get_loader, get_val_dataset

    from megatron_ext.data.loader import worker_config
    from megatron_ext.distributed import device
    from megatron_ext.model.forward_step import eval_loss, make_forward_step
    from megatron_ext.model.mrope_inputs import inputs_for

    arch = source.snapshot.arch
    dataset = get_val_dataset(data_path, split_part=split, worker_config=worker_config(0), batch_size=1, limit=limit,
                              task_encoder=_loss_encoder(source, seq_length))
    model_length = model.language_model.max_sequence_length
    forward_step = make_forward_step(inputs_for(arch, model, device()))
    total, tokens = 0.0, 0
    model.eval()
    for batch in get_loader(dataset):
        loss, n = eval_loss(model, forward_step, [batch.as_dict()], model_length, micro_batch_size=1)
        if n:
            total, tokens = total + loss * n, tokens + n
    return (total / tokens if tokens else float("nan")), tokens


def _loss_encoder(source: ModelSource, seq_length: int):
    """The task encoder the trainer trains a model of the snapshot's arch with (SFT's)."""
    from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.model.arch import LlavaArch

    arch, tokenizer_dir = source.snapshot.arch, str(source.snapshot.tokenizer_dir)
    if isinstance(arch, LlavaArch):
        return LlavaTaskEncoder.for_model(tokenizer_dir, arch, seq_length=seq_length, chat_template=source.template_name,
                                          image_aspect=source.image_aspect)
    return NativeResolutionTaskEncoder.for_model(tokenizer_dir, arch, seq_length=seq_length, pad_token_id=arch.pad_token_id,
                                                 chat_template=source.template_name)


def _table(result: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(result['checkpoint']).name} on {result['split']} ({result['samples']} samples)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in ("loss", "perplexity", "exact_match", "bleu", "rouge_l", "cider", "generated_samples",
                 "too_long_samples"):
        if name in result:
            value = result[name]
            table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
    console = Console(width=100)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def run_evaluation(open_source: Callable[[], ModelSource], options: SamplingOptions, *, data_path: str, split: str,
                   fast_n: int | None, output_dir: str, force: bool, tp: int | None, pp: int | None,
                   seq_length: int | None) -> dict:
    """scripts/eval/evaluate.py: predictions.jsonl + metrics.json in `output_dir`, a table on stdout.
    `open_source()` opens the checkpoint, once the flags are checked: a bad flag fails before it loads."""
    from megatron_ext.fsutil import atomic_output_dir, check_output_dir, write_jsonl

    if fast_n is not None and fast_n < 1:
        raise UserError(f"--fast-n must be at least 1, got {fast_n}")
    out = check_output_dir(output_dir, force, "--output-dir")
    source = open_source()
    samples = read_samples(data_path, split, limit=fast_n)
    generator = source.generator(tp, pp)
    result = {"checkpoint": str(source.path), "format": source.kind, "data_path": str(data_path), "split": split,
              "samples": len(samples), "chat_template": source.template_name, "max_new_tokens": options.max_new_tokens}
    if source.kind == "megatron":
        length = seq_length or _trained_seq_length(source) or source.context_length
        loss, tokens = megatron_loss(generator.model, source, str(data_path), split, fast_n, length)
        result.update(loss=loss, perplexity=math.exp(loss) if math.isfinite(loss) else float("nan"), loss_tokens=tokens)
    records = answer_samples(generator, source.encoder, samples, options)
    result.update(score_records(records))
    if generator.is_output_rank:
        with atomic_output_dir(out) as tmp:
            write_jsonl(tmp / PREDICTIONS_FILE, records)
            (tmp / METRICS_FILE).write_text(json.dumps(result, indent=2))
        print(_table(result), end="")
        print(f"predictions and metrics written to {out}")
    return result


def _trained_seq_length(source: ModelSource) -> int | None:
    return source.snapshot.run_config.get("seq_length")
