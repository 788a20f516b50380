"""Chat templates, and which tokens of a rendered conversation the assistant wrote.

A template is the tokenizer's own (``"tokenizer"``), a name from ``megatron_ext/data/chat_templates/``
(``plain``, ``llava-v1``, ``llama-3``, ``chatml``, ``gemma``, ``llm-jp``), or a path to a ``.jinja`` file. Unset,
the tokenizer's template is used when it has one, else the text family's chat format when its
tokenizers always hold that format's tokens (ChatML for Qwen), else the language's default.

The tokens trained are those the field trains (docs/data.md, "Loss mask"). For SFT, a template
with `{% generation %}` markers trains what they mark, transformers' assistant-token mask; a template
without them (ours, Llama-3's, Qwen2's) trains each reply's completion: for every assistant turn i,
the text rendered for `messages[:i]` with the generation prompt is a prefix of the text rendered for
`messages[:i+1]`, and what follows it is the completion, the reply with its end-of-turn token and
whatever the template puts after it (ChatML's and Gemma's "\n"), as TRL's prompt-completion split
and its training templates (Qwen2.5-VL, Qwen3, Llama-3, Gemma) train it. DPO trains the final
reply's completion with any template, TRL's DPO split. A token is trained when its characters
overlap such a span.

The rendered text is tokenized as transformers' processors tokenize a rendered chat: with the
tokenizer's special tokens unless the text already starts with the BOS (`needs_special_tokens`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from transformers.utils.chat_template_utils import render_jinja_template

from megatron_ext.data.conversation import IMAGE_MARKER, VIDEO_MARKER
from megatron_ext.errors import UserError

# transformers' test for a template that marks the assistant's text ({% generation %}, {%- generation -%}).
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Package data (pyproject.toml), so an installed copy has them as a checkout does.
TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"
LANG_DEFAULTS = {"en": "llava-v1", "ja": "llm-jp", "jp": "llm-jp"}
_PROBE = [
    {"role": "user", "content": f"{IMAGE_MARKER}\nWhat is this?"},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "What color?"},
    {"role": "assistant", "content": "Red."},
]


# Where HF checkpoints keep the chat template of their tokenizer and processor (one file for both).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Put in front of a template written for a processor: HF's structured message content, which
# lmms-eval, vLLM and `processor.apply_chat_template` send ({"type": "image"}, {"type": "video"} and
# {"type": "text"} parts), becomes the string training renders (the parts in their order, each image
# as "<image>\n", each video as "<video>\n"), and the template that follows renders it. String
# contents pass through unchanged.
_STRUCTURED_TO_TEXT = (
    "{#- megatron_ext: structured content as training renders it -#}\n"
    "{%- set _converted = namespace(messages=[]) -%}\n"
    "{%- for _message in messages -%}\n"
    "{%- if _message['content'] is string -%}\n"
    "{%- set _converted.messages = _converted.messages + [_message] -%}\n"
    "{%- else -%}\n"
    "{%- set _text = namespace(value='') -%}\n"
    "{%- for _part in _message['content'] -%}\n"
    "{%- if _part['type'] == 'image' -%}{%- set _text.value = _text.value + '" + IMAGE_MARKER + "\\n' -%}\n"
    "{%- elif _part['type'] == 'video' -%}{%- set _text.value = _text.value + '" + VIDEO_MARKER + "\\n' -%}\n"
    "{%- elif _part['type'] == 'text' -%}{%- set _text.value = _text.value + _part['text'] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set _converted.messages = _converted.messages + [{'role': _message['role'], 'content': _text.value}] -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set messages = _converted.messages %}"
)


# Behind it when the tokenizer adds its BOS itself: HF's documented LLaVA usage (and lmms-eval)
# passes the rendered text to `processor(text=...)`, which adds the BOS; rendering one too doubled it.
_NO_RENDERED_BOS = "{%- set bos_token = '' %}"


def adds_bos(tokenizer) -> bool:
    """Whether encoding with special tokens puts a BOS in front (Llama's tokenizers do; Qwen2's have none)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def needs_special_tokens(tokenizer, text: str) -> bool:
    """transformers' processor rule for rendered chats: add the tokenizer's special tokens unless the
    text already starts with the BOS. Training and generation encode by it too, so a template with
    or without a rendered BOS gives the same ids."""
    return not (tokenizer.bos_token and text.startswith(tokenizer.bos_token))


def processor_template(template: str, tokenizer) -> str:
    """`template` for a checkpoint's processor (and tokenizer: they share chat_template.jinja): the
    same text for string contents, and for HF's structured contents the text training renders;
    without a rendered BOS when `tokenizer` adds it (as llava-hf's own templates do)."""
    if template.startswith(_STRUCTURED_TO_TEXT):
        return template
    return _STRUCTURED_TO_TEXT + (_NO_RENDERED_BOS if adds_bos(tokenizer) else "") + template


def template_names() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def resolve_chat_template(name: str | None, lang: str, tokenizer, flag: str = "--chat-template", *,
                          family_default: str | None = None) -> tuple[str, str]:
    """(description, Jinja source) of the template `name` selects; `family_default`: the bundled
    template the LLaVA's text family names (`families.of(arch).text.chat_template`), used when the
    tokenizer has none."""
    if name is None:
        if tokenizer.chat_template:
            return "tokenizer", tokenizer.chat_template
        name = family_default
    if name is None:
        if lang not in LANG_DEFAULTS:
            raise UserError(f"--lang {lang!r} has no default chat template (known: {', '.join(LANG_DEFAULTS)})")
        name = LANG_DEFAULTS[lang]
    if name == "tokenizer":
        if not tokenizer.chat_template:
            raise UserError(f"{flag} tokenizer: the tokenizer has no chat template; choose one of {', '.join(template_names())}")
        return "tokenizer", tokenizer.chat_template
    path = Path(name).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        return str(path), path.read_text()
    if (TEMPLATE_DIR / f"{name}.jinja").is_file():
        return name, (TEMPLATE_DIR / f"{name}.jinja").read_text()
    raise UserError(f"{flag} {name!r} is not a template name ({', '.join(template_names())}, tokenizer) or a .jinja file")


class ChatTokenizer:
    """Renders chat messages with one template and tokenizes them, marking assistant tokens."""

    def __init__(self, tokenizer, template: str, image_token_id: int):
        if not tokenizer.is_fast:
            raise UserError("the tokenizer must be a fast (Rust) tokenizer: character offsets locate the assistant's tokens")
        if tokenizer.convert_tokens_to_ids(IMAGE_MARKER) != image_token_id:
            raise UserError(
                f"the tokenizer's {IMAGE_MARKER} token is {tokenizer.convert_tokens_to_ids(IMAGE_MARKER)}, the model's image "
                f"token is {image_token_id}; use the tokenizer saved with the checkpoint (build_llava_jp.py adds it)"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.marked = GENERATION_MARKER.search(template) is not None
        self.image_token_id = image_token_id
        try:
            self.render(_PROBE)
        except ValueError as exc:
            raise UserError(f"chat template cannot be used for training: {exc}") from exc

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans SFT trains: the `{% generation %}` blocks
        where the template marks them, else each reply's completion."""
        if self.marked:
            rendered, spans = render_jinja_template([messages], chat_template=self.template,
                                                    return_assistant_tokens_mask=True,
                                                    **self.tokenizer.special_tokens_map)
            return rendered[0], [(start, end) for start, end in spans[0] if end > start]
        text = self._apply(messages, generation_prompt=False)
        spans = [self._completion(messages[: i + 1], text) for i, message in enumerate(messages)
                 if message["role"] == "assistant"]
        return text, [(start, end) for start, end in spans if end > start]

    def _completion(self, messages: list[dict], text: str) -> tuple[int, int]:
        """The characters of `text` (the whole conversation's rendering) that follow the generation
        prompt before the last of `messages` and end its rendering: TRL's completion."""
        prompt = self._apply(messages[:-1], generation_prompt=True)
        upto = self._apply(messages, generation_prompt=False)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise ValueError(
                f"the template renders turn {len(messages) - 1} differently depending on what follows it, "
                "so the assistant's tokens cannot be located; choose another --chat-template"
            )
        return len(prompt), len(upto)

    def _tokens(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their character spans [n, 2]) of a rendered conversation."""
        encoding = self.tokenizer(text, add_special_tokens=needs_special_tokens(self.tokenizer, text),
                                  return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        return ids, np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def encode(self, messages: list[dict], completion: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64, one image token per `<image>`) and a bool mask of the tokens trained:
        SFT's (`render`), or with `completion` the last message's completion only (DPO's answer)."""
        text, spans = self.render(messages)
        if completion:
            spans = [self._completion(messages, text)]
        ids, offsets = self._tokens(text)
        trained = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        trained &= ids != self.image_token_id
        return ids, trained

    def encode_prompt(self, messages: list[dict]) -> np.ndarray:
        """Token ids of `messages` and the prompt for the assistant's next turn: what generation continues."""
        return self._tokens(self._apply(messages, generation_prompt=True))[0]

    def token_roles(self, messages: list[dict]) -> list[int | None]:
        """For each token `encode` gives, the index of the message whose rendered text it starts in
        (what the template renders before the first message counts with it, the assistant's header
        with the reply); None for the tokens the tokenizer adds itself (a BOS in front, an EOS)."""
        text, _ = self.render(messages)
        ends = [len(self._apply(messages[: i + 1], generation_prompt=False)) for i in range(len(messages))]
        starts = [0] + ends[:-1]
        _, offsets = self._tokens(text)
        roles = []
        for start, end in offsets:
            # The tokenizer's own special tokens have an empty span at 0.
            owner = next((i for i, (a, b) in enumerate(zip(starts, ends)) if a <= start < b), None)
            roles.append(None if end == start == 0 else owner)
        return roles
