"""User-facing errors: one clear line naming the file or flag and what to do."""

from __future__ import annotations

import os
import sys
import time


class UserError(Exception):
    """Bad input from the user. Printed as a single line by `run_command`, never as a traceback."""


# How long the other ranks wait before exiting on an error: torchrun stops every rank as soon as
# one has exited, and rank 0, a moment slower on a busy machine, would then never say why.
OTHER_RANKS_EXIT_DELAY_S = 5.0


def report(message: str) -> None:
    """`error: <message>` on stderr, once per run: under run.py the launcher prints the first rank's
    (megatron_ext/rank_failures.py); under torchrun alone, rank 0 prints it."""
    from megatron_ext import rank_failures

    if rank_failures.record(message):
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANKS_EXIT_DELAY_S)


def run_command(command, args: list[str] | None = None, *, obj=None, prog_name: str | None = None):
    """Run a click command as a script and exit with its status (its return value, else 0).

    Bad input, a UserError or a flag click rejects, is one line on stderr (from rank 0 only under
    torchrun, the other ranks exiting quietly with the same status 2; under run.py, from run.py:
    see `report`), never a traceback or a usage block.
    """
    import click

    try:
        status = command.main(args=args, prog_name=prog_name, obj=obj, standalone_mode=False)
    except click.ClickException as exc:
        report(exc.format_message())
        sys.exit(exc.exit_code)
    except UserError as exc:
        report(str(exc))
        sys.exit(2)
    except click.Abort:
        sys.exit(130)
    sys.exit(status or 0)
