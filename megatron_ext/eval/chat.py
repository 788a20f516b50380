"""Interactive multi-turn chat about an image in the terminal.

Commands: `/image PATH` starts a new conversation about another image, `/reset` starts a new
conversation about the same image, `/exit` (or end of input) quits. Every turn re-renders the whole
conversation with the checkpoint's chat template and answers it, streaming the reply. Under
torchrun (Megatron TP/PP) rank 0 reads the terminal and hands every line to the other ranks.
"""

from __future__ import annotations

import sys

from megatron_ext.errors import UserError
from megatron_ext.eval.checkpoints import ModelSource
from megatron_ext.eval.generation import Generator
from megatron_ext.eval.prompts import load_image, user_turn
from megatron_ext.eval.sampling import SamplingOptions

USER_PROMPT = "you> "
ASSISTANT_PREFIX = "assistant> "
HELP = "/image PATH: talk about another image   /reset: forget the conversation   /exit: quit"


class ChatSession:
    def __init__(self, source: ModelSource, generator: Generator, options: SamplingOptions, out=sys.stdout):
        self.source = source
        self.generator = generator
        self.options = options
        self.out = out
        self.image_path: str | None = None
        self.images: list = []
        self.messages: list[dict] = []

    def say(self, text: str) -> None:
        if self.generator.is_output_rank:
            print(text, file=self.out, flush=True)

    def set_image(self, path: str) -> None:
        self.images = [load_image(path, "/image")]
        self.image_path = path
        self.messages = []

    def handle(self, line: str) -> bool:
        """Act on one input line; False when the session should end."""
        line = line.strip()
        command, _, argument = line.partition(" ")
        try:
            if command == "/exit":
                return False
            if command == "/reset":
                self.messages = []
                self.say("(conversation reset)")
            elif command == "/image":
                if not argument.strip():
                    raise UserError("/image needs a path: /image PATH")
                self.set_image(argument.strip())
                self.say(f"(new conversation about {argument.strip()})")
            elif command.startswith("/"):
                self.say(f"unknown command {command}; {HELP}")
            elif line:
                self.reply(line)
        except UserError as exc:
            self.say(f"error: {exc}")
        return True

    def reply(self, text: str) -> str:
        from transformers import TextStreamer

        messages = self.messages + [user_turn(text, 0 if self.messages else len(self.images))]
        prompt = self.source.encoder.encode(messages, self.images)
        self.source.check_fits(prompt, self.options)
        if self.generator.is_output_rank:
            print(ASSISTANT_PREFIX, end="", file=self.out, flush=True)
        streamer = TextStreamer(self.source.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
        generation = self.generator.generate(prompt, self.options, streamer=streamer)
        self.messages = messages + [{"role": "assistant", "content": generation.text}]
        return generation.text


def _read_line(distributed: bool, is_reader: bool) -> str:
    """The next terminal line (rank 0 reads it, the other ranks receive it); '/exit' at end of input."""
    line = None
    if is_reader:
        try:
            line = input(USER_PROMPT)
        except EOFError:
            line = "/exit"
    if distributed:
        import torch.distributed as dist

        holder = [line]
        dist.broadcast_object_list(holder, src=0)
        line = holder[0]
    return line


def run_chat(source: ModelSource, options: SamplingOptions, *, tp: int | None, pp: int | None, image: str | None) -> None:
    """scripts/eval/chat.py."""
    import torch.distributed as dist

    first_image = load_image(image) if image else None
    session = ChatSession(source, source.generator(tp, pp), options)
    if first_image is not None:
        session.images, session.image_path = [first_image], image
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    about = f"about {image}" if image else "(no image yet: /image PATH)"
    session.say(f"chatting with {source.path} {about}; chat template: {source.template_name}\n{HELP}")
    while session.handle(_read_line(distributed, session.generator.is_output_rank)):
        pass
