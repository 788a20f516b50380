"""User-facing errors: one clear line naming the file or flag and what to do."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input from the user. Printed as a single line by `cli_entry`, never as a traceback."""


def cli_entry(func):
    """Decorate a click command body so a UserError prints `error: <message>` and exits 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
