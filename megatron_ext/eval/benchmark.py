"""Standard benchmark scores (TextVQA, GQA, MMMU, ScienceQA, ...) through lmms-eval, the evaluator
LLaVA papers report with: its task definitions, prompts and scorers, none of ours.

- HF LLaVA checkpoints run in lmms-eval's own LLaVA-HF model (`llava_hf`); the processor our converters
  write renders lmms-eval's messages as training did (`chat_template.processor_template`).
- Megatron checkpoints run directly, at any TP x PP under torchrun, in `lmms_model.MegatronLlava`.
  lmms-eval runs as a single process on every rank (it would otherwise split requests over all
  ranks, tensor-parallel peers included); the model splits them over data-parallel replicas.
- HF Qwen2.5-VL / Qwen3-VL checkpoints run in `MegatronLlava` too, with transformers' `generate`
  answering the prompts the trainer's task encoder encodes, as their Megatron checkpoints' are.

Output: lmms-eval's own files (`*_results.json`, `*_samples_<task>.jsonl`) and `summary.json`, a
list of {"task", "metric", "score", "n"}, also printed as a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.environ import environ_set
from megatron_ext.errors import UserError
from megatron_ext.eval.prompts import PromptEncoder
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES

if TYPE_CHECKING:
    from megatron_ext.eval.checkpoints import ModelSource

SUMMARY_FILE = "summary.json"
EVAL_EXTRA = "pip install 'megatron-ext[eval]'"
# lmms-eval reads the process layout from these; under torchrun they describe the model's ranks.
_RANK_VARIABLES = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}


def require_lmms_eval() -> None:
    """A one-line error when lmms-eval is missing; its own log (loguru) kept to warnings, as ours is,
    and so is numexpr's (its thread count, logged when lmms-eval's pandas loads it)."""
    logging.getLogger("numexpr").setLevel(logging.WARNING)
    try:
        # lmms-eval's model registry loads our model's entry point (eval.lmms_model) while it is built:
        # built first, before we import that module, it finds it whole (else it warns of a circular import).
        import lmms_eval.models  # noqa: F401
        from loguru import logger
    except ImportError:
        raise UserError(f"benchmarks run through lmms-eval, which is not installed: {EVAL_EXTRA}") from None
    logger.remove()
    logger.add(sys.stderr, level="WARNING")


def task_manager(tasks: list[str], include_path: str | None):
    """lmms-eval's index of the tasks: --include-path alone when it holds them all (indexing
    lmms-eval's ~2000 own tasks takes seconds), else with lmms-eval's own; unknown names refused."""
    from lmms_eval.tasks import TaskManager

    if include_path:
        local = TaskManager("WARNING", include_path=str(Path(include_path).resolve()), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager("WARNING", include_path=str(Path(include_path).resolve()) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks: unknown lmms-eval task(s) {', '.join(unknown)}; see `python -m lmms_eval --tasks list`"
                        ", or give the directory of your own task YAMLs with --include-path")
    return manager


def _single_process_view():
    """Under torchrun, lmms-eval sees one process: every rank runs it whole, the model splits the work."""
    return environ_set(_RANK_VARIABLES) if "WORLD_SIZE" in os.environ else contextlib.nullcontext()


def evaluate_tasks(model, model_args: str, tasks: list[str], manager, limit: int | None, tracker=None,
                   seeded: bool = True, task_files: Path | None = None) -> dict:
    """lmms-eval's `simple_evaluate` (collective for Megatron models); its results, samples included.
    `seeded=False` leaves the random generators alone (lmms-eval reseeds them; a trainer must not).
    Files a task's scorer writes itself (COCO's server submissions) go under `task_files`, a
    directory of this process's own: lmms-eval would put them in the working directory."""
    from lmms_eval.evaluator import simple_evaluate

    seeds = {} if seeded else dict(random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    with contextlib.ExitStack() as stack:
        if task_files is None:
            task_files = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lmms_eval_task_files_")))
        # The only command-line arguments lmms-eval's evaluator and task scorers read from it.
        cli_args = argparse.Namespace(output_path=str(task_files), process_with_media=True)
        with _single_process_view(), _task_data_reachable(tasks):
            results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                      limit=limit, log_samples=True, evaluation_tracker=tracker, bootstrap_iters=0,
                                      cli_args=cli_args, distributed_executor_backend="torchrun", verbosity="WARNING",
                                      **seeds)
    results["config"].pop("resolved_cli_args", None)  # ours, naming a temporary directory
    return results


def _unreachable(exc: BaseException) -> ConnectionError | None:
    """The `datasets` error for a task's data that could not be fetched (offline, or the Hub down),
    wherever it is in `exc`'s chain; lmms-eval wraps it in tenacity's RetryError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionError) and "on the Hub" in str(exc):
            return exc
        attempt = getattr(exc, "last_attempt", None)  # tenacity.RetryError
        exc = attempt.exception() if attempt is not None else exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def _task_data_reachable(tasks: list[str]):
    """A task whose data is neither cached nor reachable: one line saying what to fetch, not lmms-eval's traceback."""
    try:
        yield
    except Exception as exc:
        unreachable = _unreachable(exc)
        if unreachable is None:
            raise
        from datasets import config

        raise UserError(f"--tasks {','.join(tasks)}: lmms-eval cannot load a task's data: {unreachable}; download it "
                        f"once where the Hub is reachable (the same command without HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
                        f"caches it in {config.HF_DATASETS_CACHE}), or give --include-path task YAMLs whose "
                        "dataset_path is a local copy (docs/benchmarks.md)") from None


class BenchmarkEvaluation:
    """--eval-benchmarks: the trainer's model scored on lmms-eval tasks at every evaluation (the first
    --eval-benchmark-limit samples of each), as scripts/eval/benchmark.py scores a checkpoint."""

    def __init__(self, plan):
        from megatron_ext.eval.evaluation import TrainerPrompts

        cfg = plan.config
        require_lmms_eval()
        self.tasks = [t for t in cfg.eval_benchmarks.split(",") if t]
        self.limit = cfg.eval_benchmark_limit
        self.manager = task_manager(self.tasks, cfg.eval_benchmark_include_path)
        self.prompts = TrainerPrompts(plan)

    def run(self, model) -> dict:
        """{"benchmark/<task>/<metric>": score}; collective, the same on every rank."""
        from megatron_ext.eval.lmms_model import MegatronLlava

        lm = MegatronLlava(encoder=self.prompts.encoder, generator=self.prompts.generator(model))
        results = evaluate_tasks(lm, "", self.tasks, self.manager, self.limit, seeded=False)
        return {f"benchmark/{row['task']}/{row['metric']}": row["score"] for row in summarize(results)}


def summarize(results: dict) -> list[dict]:
    """One row per task and metric: lmms-eval's "metric,filter" keys, stderr and aliases left out."""
    rows = []
    for task, metrics in results["results"].items():
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, score in metrics.items():
            metric = key.split(",")[0]
            if key == "alias" or "_stderr" in metric or not isinstance(score, (int, float)):
                continue
            rows.append({"task": task, "metric": metric, "score": float(score), "n": n})
    return rows


def _table(rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lmms-eval scores")
    for column in ("task", "metric", "score", "n"):
        table.add_column(column, justify="right" if column in ("score", "n") else "left")
    for row in rows:
        table.add_row(row["task"], row["metric"], f"{row['score']:.4f}", str(row["n"]))
    console = Console(width=100)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def _log_scores(rows: list[dict], tensorboard_dir: str | None, wandb_project: str | None, step: int) -> None:
    scalars = {f"benchmark/{r['task']}/{r['metric']}": r["score"] for r in rows}
    if tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=tensorboard_dir) as writer:
            for name, value in scalars.items():
                writer.add_scalar(name, value, step)
    if wandb_project:
        import wandb

        with wandb.init(project=wandb_project, job_type="benchmark") as run:
            run.log(scalars, step=step)


def run_benchmark(open_source: Callable[[], ModelSource], *, tasks: list[str], include_path: str | None,
                  output_dir: str, force: bool, limit: int | None, tp: int | None, pp: int | None,
                  tensorboard_dir: str | None = None, wandb_project: str | None = None,
                  video_frames: int = DEFAULT_VIDEO_FRAMES) -> list[dict]:
    """scripts/eval/benchmark.py: lmms-eval on the checkpoint `open_source()` opens once the flags and
    tasks are checked (a bad one fails before it loads), files in `output_dir`; `video_frames`: frames
    per video on the Megatron path."""
    from megatron_ext.fsutil import atomic_output_dir, check_output_dir

    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}")
    if include_path and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path} is not a directory of task YAMLs")
    out = check_output_dir(output_dir, force, "--output-dir")
    require_lmms_eval()
    from lmms_eval.loggers import EvaluationTracker

    manager = task_manager(tasks, include_path)
    source = open_source()
    if source.kind == "hf" and isinstance(source.encoder, PromptEncoder):
        import torch

        model = model_name = "llava_hf"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model_args = f"pretrained={source.path},device={device},device_map={device},dtype={source.dtype}"
        output_rank = True
    else:
        from megatron_ext.eval.lmms_model import MODEL_ID, MegatronLlava

        # A native-resolution HF checkpoint too: its prompts encoded as the Megatron checkpoint's are,
        # answered by transformers' generate (source.generator()).
        model = MegatronLlava(encoder=source.encoder, generator=source.generator(tp, pp), video_frames=video_frames)
        model_args = f"pretrained={source.path}"  # names the run in lmms-eval's results
        output_rank = model.generator.is_output_rank
        model_name = MODEL_ID
    tracker = EvaluationTracker()  # its output path is set once the results are in
    with tempfile.TemporaryDirectory(prefix="lmms_eval_task_files_") as task_files:
        results = evaluate_tasks(model, model_args, tasks, manager, limit, tracker, task_files=Path(task_files))
        # What the results file records as the model (it would try to copy a model object).
        tracker.general_config_tracker.model_source = model_name
        rows = summarize(results)
        if output_rank:
            samples = results.pop("samples")
            with atomic_output_dir(out) as tmp:
                tracker.output_path = str(tmp)
                tracker.save_results_aggregated(results=results, samples=samples, datetime_str=results["date"])
                for task in results["configs"]:
                    tracker.save_results_samples(task_name=task, samples=samples[task])
                (tmp / SUMMARY_FILE).write_text(json.dumps(rows, indent=2))
                for written in Path(task_files).iterdir():
                    shutil.move(written, tmp / written.name)
    if output_rank:
        _log_scores(rows, tensorboard_dir, wandb_project, step=source.snapshot.iteration if source.snapshot else 0)
        print(_table(rows), end="")
        print(f"lmms-eval results and samples written to {out}")
    return rows
