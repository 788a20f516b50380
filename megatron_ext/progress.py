"""Progress bars for the long commands (conversion, dataset building, generation and evaluation
over a file): shown on a terminal only, by one process (rank 0), and never with --quiet; the
libraries' own bars follow the same rule.

--quiet is an environment variable (QUIET_ENV) rather than an argument threaded through every
function, so the worker processes a command starts (converter ranks, torchrun ranks) follow it too.
"""

from __future__ import annotations

import os
import sys

QUIET_ENV = "MEGATRON_EXT_QUIET"


def set_quiet(quiet: bool) -> None:
    """--quiet: no progress bars here or in the processes started from now on."""
    if quiet:
        os.environ[QUIET_ENV] = "1"


def _shown() -> bool:
    return sys.stderr.isatty() and not os.environ.get(QUIET_ENV) and int(os.environ.get("RANK", "0")) == 0


def progress(iterable=None, *, total: int | None = None, desc: str, unit: str = "it", unit_scale: bool = False):
    """tqdm over `iterable` (or a bar to `update` by hand), with its rate and ETA, or a silent one."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=not _shown(),
                dynamic_ncols=True)


def quiet_library_bars() -> None:
    """The bars transformers and huggingface_hub draw themselves (loading weights, downloads) follow
    the same rule; they would otherwise draw them into logs and onto every rank's output."""
    if _shown():
        return
    # Read when huggingface_hub is imported (transformers follows it), here and in processes started from here.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for module, switch in (("huggingface_hub.utils", "disable_progress_bars"),
                           ("transformers.utils.logging", "disable_progress_bar")):
        if module in sys.modules:  # imported already
            getattr(sys.modules[module], switch)()


def quiet_option(func):
    """--quiet for a click command: no progress bars (taken before the command body runs)."""
    import click

    return click.option("--quiet", is_flag=True, expose_value=False, is_eager=True,
                        callback=lambda ctx, param, value: set_quiet(value),
                        help="No progress bars (they are also off when stderr is not a terminal).")(func)
