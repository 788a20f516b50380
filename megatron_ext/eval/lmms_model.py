"""Our checkpoints as an lmms-eval model, so lmms-eval's own tasks and scorers grade them.

`MegatronLlava` is a chat model in lmms-eval's sense: each request carries HF-structured messages
(`{"type": "image"}`, `{"type": "video"}` and `{"type": "text"}` parts). They become the string
form training renders (each image as `<image>\\n` before its text: the rule
`chat_template.processor_template` gives HF processors; each video, decoded to `video_frames`
frames by the prompt encoder, as `<video>\\n`), and the checkpoint's prompt encoder and generator
answer them: a Megatron checkpoint at its TP x PP under torchrun, or a native-resolution model's HF
checkpoint (Qwen2.5-VL, Qwen3-VL) with transformers' `generate`, its prompts encoded as the
Megatron path encodes them. Data-parallel replicas split the requests and exchange the answers, so
lmms-eval itself runs as one process on every rank and sees every answer.

Registered for lmms-eval's own CLI as `megatron_llava` (entry point `lmms_eval.models`).
"""

from __future__ import annotations

from collections.abc import Callable

from lmms_eval.api.instance import GenerationResult, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest

from megatron_ext.data.conversation import IMAGE_MARKER
from megatron_ext.eval.prompts import load_image
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.families.llava import DEFAULT_VIDEO_FRAMES, VIDEO_TOKEN

MODEL_ID = "megatron_llava"
MANIFEST = ModelManifest(model_id=MODEL_ID, chat_class_path=f"{__name__}.MegatronLlava")
# lmms-eval's LLaVA-HF chat model answers with this many new tokens when a task sets none.
DEFAULT_MAX_NEW_TOKENS = 1024


def as_training_messages(messages: list[dict], read_video: Callable) -> tuple[list[dict], list, list]:
    """(messages with string contents, their images in order, their videos in order) from
    HF-structured messages; `read_video(url)` gives what the prompt encoder takes of a video part."""
    converted, images, videos = [], [], []
    for message in messages:
        text = ""
        for part in message["content"]:
            if part["type"] == "image":
                text += f"{IMAGE_MARKER}\n"
                images.append(load_image(part["url"], "image") if isinstance(part["url"], str) else part["url"])
            elif part["type"] == "video":
                text += f"{VIDEO_TOKEN}\n"
                videos.append(read_video(part["url"]))
            elif part["type"] == "text":
                text += part["text"]
            else:
                raise ValueError(f"{part['type']} inputs are not supported by {MODEL_ID}")
        converted.append({"role": message["role"], "content": text})
    return converted, images, videos


def sampling_options(gen_kwargs: dict) -> SamplingOptions:
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    return SamplingOptions(max_new_tokens=int(gen_kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                           temperature=temperature if gen_kwargs.get("do_sample", temperature > 0) else 0.0,
                           top_p=float(gen_kwargs.get("top_p") or 1.0))


def cut_at_stops(text: str, until) -> str:
    """The answer up to the first of the task's stop strings."""
    for stop in [until] if isinstance(until, str) else until or []:
        if stop:
            text = text.split(stop)[0]
    return text


class MegatronLlava(lmms):
    """lmms-eval model over a Megatron checkpoint (`megatron_dir`: lmms-eval's CLI, one process), or
    over a prompt encoder and a generator (benchmark.py and the trainer pass theirs)."""

    is_simple = False

    def __init__(self, megatron_dir: str | None = None, tp: int | None = None, pp: int | None = None,
                 dtype: str = "auto", chat_template: str | None = None, image_aspect: str | None = None,
                 encoder=None, generator=None, video_frames: int = DEFAULT_VIDEO_FRAMES, **unused):
        super().__init__()
        from megatron_ext.errors import UserError
        from megatron_ext.eval.checkpoints import open_checkpoint, world_size

        if generator is None:
            if world_size() > 1:
                # lmms-eval's own CLI would hand tensor-parallel peers different requests.
                raise UserError("under torchrun, score Megatron checkpoints with scripts/eval/benchmark.py "
                                "(lmms-eval's CLI runs megatron_llava in one process)")
            source = open_checkpoint(megatron_dir, None, chat_template, dtype, image_aspect)
            encoder, generator = source.encoder, source.generator(tp and int(tp), pp and int(pp))
        self.encoder = encoder
        self.generator = generator
        self.video_frames = int(video_frames)

    def generate_until(self, requests) -> list[GenerationResult]:
        from megatron_ext.distributed import split_over_data_parallel

        return split_over_data_parallel(requests, lambda mine: [self._answer(request) for request in mine])

    def _answer(self, request) -> GenerationResult:
        _, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
        messages, images, videos = as_training_messages(doc_to_messages(self.task_dict[task][split][doc_id]),
                                                        self._read_video)
        prompt = self.encoder.encode(messages, images, videos)
        generation = self.generator.generate(prompt, sampling_options(gen_kwargs))
        # Decoded as lmms-eval's llava_hf decodes (no stripping), so both paths record the same text.
        text = self.generator.processor.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        return GenerationResult(text=cut_at_stops(text, gen_kwargs.get("until")),
                                token_counts=TokenCounts(output_tokens=len(generation.token_ids)))

    def _read_video(self, url):
        return self.encoder.load_video(url, self.video_frames, "video")

    def loglikelihood(self, requests):
        raise NotImplementedError("megatron_llava answers generation tasks (output_type: generate_until) only")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("megatron_llava answers single-round generation tasks only")
