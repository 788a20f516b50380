"""User-facing errors: one clear line naming the file or flag and what to do."""

from __future__ import annotations

import os
import sys
import time


class UserError(Exception):
    """Bad input from the user. Printed as a single line by `run_command`, never as a traceback."""


def report(message: str) -> None:
    """`error: <message>` on stderr, once per run: under run.py (and in the converters' ranks) the
    starter prints the first rank's (megatron_ext/rank_failures.py); under torchrun alone, rank 0
    prints it at once, another rank only if it is still running a moment later (torchrun stops it
    as soon as rank 0 exits: then rank 0 has said it)."""
    from megatron_ext import rank_failures

    if rank_failures.record(message):
        return
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(rank_failures.OTHER_RANKS_EXIT_DELAY_S)
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_command(command, args: list[str] | None = None, *, obj=None, prog_name: str | None = None):
    """Run a click command as a script and exit with its status (its return value, else 0).

    Bad input, a UserError or a flag click rejects, is one line on stderr (once under torchrun: see
    `report`), never a traceback or a usage block. A bug in a worker rank the command started is that
    rank's traceback and one line; one in a rank under run.py is left for run.py (`rank_failures`).
    """
    import click

    from megatron_ext import rank_failures

    with rank_failures.recorded():
        try:
            status = command.main(args=args, prog_name=prog_name, obj=obj, standalone_mode=False)
        except click.ClickException as exc:
            report(exc.format_message())
            sys.exit(exc.exit_code)
        except UserError as exc:
            report(str(exc))
            sys.exit(2)
        except rank_failures.RankFailed as exc:
            rank_failures.show(exc.failure)
            sys.exit(1)
        except click.Abort:
            sys.exit(130)
    sys.exit(status or 0)
