"""User-facing errors: one clear line naming the file or flag and what to do."""

from __future__ import annotations

import os
import sys


class UserError(Exception):
    """Bad input from the user. Printed as a single line by `run_command`, never as a traceback."""


def report(message: str) -> None:
    """`error: <message>` on stderr, once per run: under torchrun only rank 0 prints it."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)


def run_command(command, args: list[str] | None = None, *, obj=None, prog_name: str | None = None):
    """Run a click command as a script and exit with its status (its return value, else 0).

    Bad input, a UserError or a flag click rejects, is one line on stderr (from rank 0 only under
    torchrun; the other ranks exit quietly with the same status 2), never a traceback or a usage block.
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
