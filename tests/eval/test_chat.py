"""scripts/eval/chat.py driven in a pseudo-terminal: two turns about an image from a Megatron
checkpoint, each answer equal to transformers' greedy answer to the same conversation; /image,
/reset and /exit."""

from __future__ import annotations

import sys

import pexpect
import pytest

from megatron_ext.data.conversation import IMAGE_MARKER
from megatron_ext.eval.chat import ASSISTANT_PREFIX, USER_PROMPT
from tests.helpers import REPO_ROOT, child_env

MAX_NEW_TOKENS = 8


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


def _same_text(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_turns_about_an_image_then_reset_image_and_exit(megatron_clip, images, hf_reference):
    term = Terminal("--megatron-dir", megatron_clip, "--image", images[0], "--max-new-tokens", MAX_NEW_TOKENS)
    try:
        _converse(term, images, hf_reference)
    finally:
        term.child.close(force=True)  # the chat (a session leader in its pty) does not outlive the test
    assert term.child.exitstatus == 0


def _converse(term, images, hf_reference):
    from megatron_ext.eval.prompts import load_image

    assert f"about {images[0]}" in term.banner and "/image PATH" in term.banner

    first_q, second_q = "Describe this image.", "What else do you see?"
    image0 = [load_image(images[0])]
    conversation = [{"role": "user", "content": f"{IMAGE_MARKER}\n{first_q}"}]
    first = term.answer(first_q)
    expected_first = hf_reference.text(hf_reference.greedy(conversation, image0, MAX_NEW_TOKENS))
    assert expected_first and _same_text(first, expected_first), (first, expected_first)

    # The second turn sees the first question and answer (the image only in the first user turn).
    conversation += [{"role": "assistant", "content": expected_first}, {"role": "user", "content": second_q}]
    second = term.answer(second_q)
    expected_second = hf_reference.text(hf_reference.greedy(conversation, image0, MAX_NEW_TOKENS))
    assert expected_second and _same_text(second, expected_second), (second, expected_second)

    # /reset forgets the conversation: the same first question gets the first answer again.
    assert term.ask("/reset") == "(conversation reset)"
    assert _same_text(term.answer(first_q), expected_first)

    assert term.ask(f"/image {images[1]}") == f"(new conversation about {images[1]})"
    expected_other = hf_reference.text(hf_reference.greedy(
        [{"role": "user", "content": f"{IMAGE_MARKER}\n{first_q}"}], [load_image(images[1])], MAX_NEW_TOKENS))
    assert _same_text(term.answer(first_q), expected_other)

    assert term.ask("/image /no/such.png").startswith("error: /image /no/such.png does not exist")
    assert term.ask("/help").startswith("unknown command /help")

    term.child.sendline("/exit")
    term.child.expect_exact(pexpect.EOF)
