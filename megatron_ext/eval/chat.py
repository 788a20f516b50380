"""Interactive multi-turn chat about an image or a video in the terminal.

Commands: `/image PATH` starts a new conversation about another image, `/video PATH` one about a
video (LLaVA-OneVision, Qwen2.5-VL; decoded to --video-frames frames), `/reset` starts a new conversation about
the same image or video, `/exit` (or end of input) quits. Every turn re-renders the whole
conversation with the checkpoint's chat template and answers it, streaming the reply; the image or
video goes in its first user turn. Under torchrun (Megatron TP/PP) rank 0 reads the terminal and
hands every line to the other ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from megatron_ext.errors import UserError
from megatron_ext.eval.checkpoints import ModelSource
from megatron_ext.eval.generation import Generator
from megatron_ext.eval.prompts import load_image, user_turn
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES

USER_PROMPT = "you> "
ASSISTANT_PREFIX = "assistant> "
HELP = ("/image PATH: talk about another image   /video PATH: about a video   /reset: forget the conversation   "
        "/exit: quit")


@dataclass(frozen=True)
class Media:
    """What a conversation is about: one image, one video (uint8 frames [n, H, W, 3]) or nothing."""

    path: str | None = None
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


def load_media(source: ModelSource, flag: str, path: str, video_frames: int) -> Media:
    """The image (`flag` --image or /image) or video (--video or /video) at `path`, or a one-line
    UserError: no such file, not decodable, or a video for a model that takes none."""
    if flag in ("--video", "/video"):
        source.encoder.check_takes_videos()  # before decoding: the refusal costs no wait
        return Media(path, videos=[source.encoder.load_video(path, video_frames, flag)])
    return Media(path, images=[load_image(path, flag)])


class ChatSession:
    def __init__(self, source: ModelSource, generator: Generator, options: SamplingOptions, out=sys.stdout,
                 video_frames: int = DEFAULT_VIDEO_FRAMES, media: Media | None = None):
        self.source = source
        self.generator = generator
        self.options = options
        self.out = out
        self.video_frames = video_frames
        self.media = media or Media()
        self.messages: list[dict] = []

    def say(self, text: str) -> None:
        if self.generator.is_output_rank:
            print(text, file=self.out, flush=True)

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
            elif command in ("/image", "/video"):
                if not argument.strip():
                    raise UserError(f"{command} needs a path: {command} PATH")
                # Loaded before anything changes: a refused path keeps the current conversation.
                self.media, self.messages = load_media(self.source, command, argument.strip(), self.video_frames), []
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

        # The image or video goes in the first user turn only.
        counts = (0, 0) if self.messages else (len(self.media.images), len(self.media.videos))
        messages = self.messages + [user_turn(text, *counts)]
        prompt = self.source.encoder.encode(messages, self.media.images, self.media.videos)
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


def run_chat(source: ModelSource, options: SamplingOptions, *, tp: int | None, pp: int | None, image: str | None,
             video: str | None = None, video_frames: int = DEFAULT_VIDEO_FRAMES) -> None:
    """scripts/eval/chat.py (`image` and `video`: at most one)."""
    import torch.distributed as dist

    media = Media()
    if image or video:  # read before the model loads: a bad path costs no wait
        media = load_media(source, "--video" if video else "--image", video or image, video_frames)
    session = ChatSession(source, source.generator(tp, pp), options, video_frames=video_frames, media=media)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    about = f"about {media.path}" if media.path else "(no image or video yet: /image PATH, /video PATH)"
    session.say(f"chatting with {source.path} {about}; chat template: {source.template_name}\n{HELP}")
    while session.handle(_read_line(distributed, session.generator.is_output_rank)):
        pass
