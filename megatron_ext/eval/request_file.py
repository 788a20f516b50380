"""Answering many image + prompt requests: read and check them all, then generate, then write.

Input JSONL, one request a line: ``{"image": "cat.jpg", "prompt": "What is this?", "id": "any"}``
(`image` optional: one file or a list of files, relative paths taken from the JSONL file's folder;
the prompt places them with `<image>` markers, else they go before it; `video` likewise, with
`<video>` markers, for models that take videos (OneVision), each decoded to --video-frames frames;
`id` optional, default the line number). Output JSONL: each request with `answer`,
`finish_reason` and `token_ids` added, written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.data.conversation import BadConversation, image_files, video_files
from megatron_ext.errors import UserError
from megatron_ext.eval.checkpoints import ModelSource
from megatron_ext.eval.generation import Generation, Generator
from megatron_ext.eval.prompts import EncodedPrompt, load_image, user_turn
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES
from megatron_ext.fsutil import write_jsonl
from megatron_ext.progress import progress


@dataclass
class Request:
    record: dict  # as given, plus "id"
    prompt: EncodedPrompt


def encode_request(source: ModelSource, prompt: str, images: list, options: SamplingOptions,
                   videos: list = ()) -> EncodedPrompt:
    """One user turn about the images and videos, checked to fit in the context."""
    encoded = source.encoder.encode([user_turn(prompt, len(images), len(videos))], images, videos)
    source.check_fits(encoded, options)
    return encoded


def read_requests(path: str | Path, source: ModelSource, options: SamplingOptions, video_frames: int,
                  flag: str = "--input-jsonl") -> list[Request]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{flag} {path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where} is not JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f"{where} needs a \"prompt\" string (and optionally \"image\", \"video\" and \"id\")")
        try:
            files, videos = image_files(record), video_files(record)
        except BadConversation as exc:
            raise UserError(f"{where}: {exc.detail}") from None
        images = [load_image(path.parent / f, f"{where}: image") for f in files]
        videos = [source.encoder.load_video(path.parent / f, video_frames, f"{where}: video") for f in videos]
        try:
            encoded = encode_request(source, record["prompt"], images, options, videos)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        requests.append(Request({"id": number, **record}, encoded))
    if not requests:
        raise UserError(f"{flag} {path} holds no requests")
    return requests


def _answered(request: Request, generation: Generation) -> dict:
    return {**request.record, "answer": generation.text, "finish_reason": generation.finish_reason,
            "token_ids": generation.token_ids}


def answer_all(generator: Generator, requests: list[Request], options: SamplingOptions) -> list[dict]:
    """Every request answered in order (collective for Megatron generators)."""
    return [_answered(request, generator.generate(request.prompt, options))
            for request in progress(requests, desc="answering", unit="request")]


def generate_answers(source: ModelSource, options: SamplingOptions, *, tp: int | None, pp: int | None,
                     images: tuple[str, ...], prompt: str | None, input_jsonl: str | None, output_jsonl: str | None,
                     videos: tuple[str, ...] = (), video_frames: int = DEFAULT_VIDEO_FRAMES) -> None:
    """scripts/eval/generate.py: one prompt (streamed to the terminal) or a JSONL batch."""
    import sys

    from transformers import TextStreamer

    if (prompt is None) == (input_jsonl is None):
        raise UserError("give either --prompt (with --image) or --input-jsonl")
    if input_jsonl:
        if images or videos:
            raise UserError("--image and --video go with --prompt; in --input-jsonl every line names its own")
        requests = read_requests(input_jsonl, source, options, video_frames)
    else:
        record = {"id": 1, "image": images[0] if len(images) == 1 else list(images) or None, "prompt": prompt}
        if videos:
            record["video"] = videos[0] if len(videos) == 1 else list(videos)
        encoded = encode_request(source, prompt, [load_image(i) for i in images], options,
                                 [source.encoder.load_video(v, video_frames) for v in videos])
        requests = [Request(record, encoded)]
    generator = source.generator(tp, pp)
    if prompt is not None:
        streamer = TextStreamer(source.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
        results = [_answered(requests[0], generator.generate(requests[0].prompt, options, streamer=streamer))]
    else:
        results = answer_all(generator, requests, options)
    if not generator.is_output_rank:
        return
    if output_jsonl:
        write_jsonl(output_jsonl, results)
        print(f"{len(results)} answers written to {output_jsonl}", file=sys.stderr)
    elif input_jsonl:
        for record in results:
            print(json.dumps(record, ensure_ascii=False))
