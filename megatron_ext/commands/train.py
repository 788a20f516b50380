"""megatron-ext-train: the launcher (scripts/train/run.py runs the same command).

    megatron-ext-train -g 8 --tp 4 --pp 1 --name run1 --megatron-load-dir CKPT --save --save-dir OUT \
        --data-path DATA [--sif-path image.sif] --stage 2 -- --lr 1e-5 --seq-length 2048
    megatron-ext-train plan --layouts 4x2,8x1,2x4 -g 8 ... (the same flags): the memory plan of each layout
    megatron-ext-train report SAVE_DIR [--png]: an HTML page of a run (going or done) from its records

Trainer options without a flag here go after `--`. --dry-run prints the exact command and exits.
Flags, defaults and examples: docs/launcher.md.
"""

import sys

import click

from megatron_ext.errors import run_command
from megatron_ext.launch.flags import LaunchOptions, invoke, launcher_options
from megatron_ext.train.flops import H100_BF16_PEAK_TFLOPS

CONTEXT = {"max_content_width": 110, "help_option_names": ["-h", "--help"]}


@click.command(context_settings=CONTEXT)
@launcher_options
@click.pass_obj
def launch(passthrough, **values):
    """Launch the trainer (megatron_ext/train/pretrain_llava.py) under torchrun. Trainer options without a flag here go after `--`.

    \b
    Two more commands of megatron-ext-train, its first word (scripts/train/report.py is the second):
      plan [--layouts 4x2,8x1] FLAGS...  the memory plan of each TPxPP layout, side by side; nothing starts
      report SAVE_DIR [--png]            an HTML page of a run (going or done) from its own records
    """
    from megatron_ext.launch.launcher import main as run_launcher

    return run_launcher(LaunchOptions.of(values), passthrough)


@click.command(name="megatron-ext-train plan", context_settings=CONTEXT)
@click.option("--layouts", default=None, help="TPxPP layouts to plan side by side, e.g. 4x2,8x1,2x4 (default: --tp x --pp).")
@launcher_options
@click.pass_obj
def plan(passthrough, layouts, **values):
    """The per-GPU memory plan of the run these flags describe, at each of --layouts; nothing starts."""
    from megatron_ext.launch.launcher import print_layout_plans

    return print_layout_plans(LaunchOptions.of(values), passthrough, layouts)


@click.command(name="megatron-ext-train report", context_settings=CONTEXT)
@click.argument("save_dir", type=click.Path(file_okay=False))
@click.option("--output", type=click.Path(dir_okay=False), default=None, help="The page to write (default: SAVE_DIR/report.html).")
@click.option("--png", is_flag=True, help="Also write each chart as a PNG, in report_png/ beside the page.")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), default=H100_BF16_PEAK_TFLOPS, show_default=True,
              help="Peak dense TFLOP/s per GPU the MFU is taken against (989: H100 SXM bf16).")
def report(save_dir, output, png, peak_tflops):
    """An HTML page of the run in SAVE_DIR (its --save-dir), from its own records: works while it runs."""
    from megatron_ext.pages.run_report import write_report

    click.echo(f"Report written to {write_report(save_dir, output, png, peak_tflops)}")


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["plan"]:
        invoke(plan, argv[1:])
    elif argv[:1] == ["report"]:
        run_command(report, argv[1:])
    else:
        invoke(launch, argv)


if __name__ == "__main__":
    main()
