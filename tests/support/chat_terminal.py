"""scripts/eval/chat.py driven in a pseudo-terminal, for the chat tests."""

from __future__ import annotations

import sys

import pexpect

from megatron_ext.eval.chat import ASSISTANT_PREFIX, USER_PROMPT
from tests.support.helpers import REPO_ROOT, child_env


class Terminal:
    """A chat session in a pty; `ask` sends one line and returns what was printed before the next prompt."""

    def __init__(self, *args):
        self.child = pexpect.spawn(sys.executable, [str(REPO_ROOT / "scripts/eval/chat.py"), *map(str, args)],
                                   cwd=str(REPO_ROOT), env=child_env(), encoding="utf-8", timeout=120)
        self.banner = self._until_prompt()

    def _until_prompt(self) -> str:
        self.child.expect_exact(USER_PROMPT)
        return self.child.before.replace("\r\n", "\n")

    def ask(self, line: str) -> str:
        self.child.sendline(line)
        self.child.expect_exact(line)  # the terminal's echo of what was typed
        return self._until_prompt().strip()

    def answer(self, line: str) -> str:
        printed = self.ask(line)
        assert printed.startswith(ASSISTANT_PREFIX), printed
        return printed[len(ASSISTANT_PREFIX):].strip()


def same_text(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())
