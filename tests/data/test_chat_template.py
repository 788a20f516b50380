"""Chat templates: the assistant-token mask, with and without {% generation %} markers."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext import families
from megatron_ext.data.chat_template import ChatTokenizer, needs_special_tokens, resolve_chat_template, template_names
from megatron_ext.data.conversation import BadConversation, llava_messages, place_images, qa_messages
from megatron_ext.errors import UserError

CONVERSATION = [
    {"role": "user", "content": "<image>\nWhat is in the picture?"},
    {"role": "assistant", "content": "A red cat on a sofa."},
    {"role": "user", "content": "この画像には何が写っていますか？"},
    {"role": "assistant", "content": "赤いソファの上に猫が座っています。"},
]
# What each named template puts before the reply and after it (its end of turn and what follows it):
# the trained span, TRL's completion.
EXPECTED_REPLY = {
    "plain": ("", "<|end|>"),
    "llava-v1": (" ", "<|end|>"),
    "llama-3": ("", "<|eot_id|>"),
    "chatml": ("", "<|im_end|>\n"),
    "gemma": ("", "<end_of_turn>\n"),
    "llm-jp": ("", "<|end|>"),
}


@pytest.fixture(scope="module")
def tokenizer(llava_clip):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llava_clip)


def _chat(tokenizer, name, lang="en"):
    return ChatTokenizer(tokenizer, resolve_chat_template(name, lang, tokenizer)[1], tokenizer.convert_tokens_to_ids("<image>"))


def test_mask_matches_hf_generation_markers(tokenizer):
    """The tiny tokenizer's template marks assistant text with {% generation %}: HF's own mask
    must equal ours, which never looks at those markers."""
    ids, assistant = _chat(tokenizer, "tokenizer").encode(CONVERSATION)
    hf = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    # This template renders no BOS; as transformers' processors do, the tokenizer then adds its own
    # (a tokenizer's apply_chat_template never adds one).
    assert ids.tolist() == [tokenizer.bos_token_id] + hf["input_ids"]
    assert assistant.tolist() == [False] + [bool(x) for x in hf["assistant_masks"]]


def test_a_marked_template_trains_its_marks_for_sft_and_the_whole_completion_for_dpo(tokenizer):
    """transformers' assistant mask for SFT; TRL's DPO split, the "\n" after the turn included, for DPO."""
    chat = _chat(tokenizer, "tokenizer")
    ids, sft = chat.encode(CONVERSATION[:2])
    _, dpo = chat.encode(CONVERSATION[:2], completion=True)
    assert tokenizer.decode(ids[sft]) == "A red cat on a sofa.<|end|>"
    assert tokenizer.decode(ids[dpo]) == "A red cat on a sofa.<|end|>\n"


@pytest.mark.parametrize("name", sorted(EXPECTED_REPLY))
def test_named_templates_train_exactly_the_replies(tokenizer, name):
    chat = _chat(tokenizer, name)
    ids, assistant = chat.encode(CONVERSATION)
    lead, end = EXPECTED_REPLY[name]
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert tokenizer.decode(ids[assistant]) == "".join(lead + r + end for r in replies)
    # Exactly one image token, never trained.
    image = tokenizer.convert_tokens_to_ids("<image>")
    assert (ids == image).sum() == 1 and not assistant[ids == image].any()
    # One contiguous run of assistant tokens per reply (plain renders no user text between them).
    starts = np.flatnonzero(np.diff(assistant.astype(int)) == 1)
    assert len(starts) == (1 if name == "plain" else 2)


def test_default_template_follows_tokenizer_then_family_then_language(tokenizer):
    assert resolve_chat_template(None, "en", tokenizer)[0] == "tokenizer"
    assert resolve_chat_template(None, "en", tokenizer, family_default="chatml")[0] == "tokenizer"
    without = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    without.chat_template = None
    assert resolve_chat_template(None, "en", without)[0] == "llava-v1"
    assert resolve_chat_template(None, "ja", without)[0] == "llm-jp"
    # Every Qwen tokenizer holds ChatML's tokens; a Llama-type one need not hold Llama-3's.
    assert resolve_chat_template(None, "ja", without, family_default=families.text_family("qwen3").chat_template)[0] == "chatml"
    assert resolve_chat_template(None, "en", without, family_default=families.text_family("llama").chat_template)[0] == "llava-v1"
    assert resolve_chat_template("plain", "en", without, family_default="chatml")[0] == "plain"
    assert "### 応答:" in resolve_chat_template(None, "ja", without)[1]
    with pytest.raises(UserError, match="has no chat template"):
        resolve_chat_template("tokenizer", "en", without)
    with pytest.raises(UserError, match="not a template name"):
        resolve_chat_template("vicuna-v0", "en", tokenizer)
    assert {"plain", "llava-v1", "llama-3", "chatml", "llm-jp"} <= set(template_names())


def test_qwen_checkpoint_whose_tokenizer_has_no_template_trains_with_chatml(llava_qwen2_siglip, tmp_path):
    import json
    import shutil

    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.families import read_llava

    stripped = shutil.copytree(llava_qwen2_siglip, tmp_path / "model", ignore=shutil.ignore_patterns("chat_template.*"))
    config = json.loads((stripped / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (stripped / "tokenizer_config.json").write_text(json.dumps(config))
    arch = read_llava(json.loads((stripped / "config.json").read_text()))
    encoder = LlavaTaskEncoder.for_model(str(stripped), arch, seq_length=512)
    assert encoder.template_name == "chatml"
    text, _ = encoder.chat.render(CONVERSATION)
    assert text.startswith("<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n")


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # Renders the last message differently, so earlier renderings are not prefixes of later ones.
    template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(UserError, match="cannot be used for training"):
        ChatTokenizer(tokenizer, template, tokenizer.convert_tokens_to_ids("<image>"))


def test_wrong_image_token_is_refused(tokenizer):
    with pytest.raises(UserError, match="image token"):
        ChatTokenizer(tokenizer, tokenizer.chat_template, -200)


def test_image_goes_where_marked_or_before_the_first_question():
    marked = place_images(qa_messages("Look: <image> what?", "A dog."), 1)
    assert marked[0]["content"] == "Look: <image> what?"
    unmarked = place_images([{"role": "system", "content": "Be brief."}, *qa_messages("What?", "A dog.")], 1)
    assert unmarked[1]["content"] == "<image>\nWhat?"
    with pytest.raises(BadConversation, match="number of <image> markers"):
        place_images(qa_messages("<image><image> what?", "A dog."), 1)


@pytest.mark.parametrize("turns,reason", [
    ([{"from": "human", "value": "<image> hi"}], "no gpt turn"),
    ([{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "  "}], "empty answer"),
    ([{"from": "robot", "value": "x"}], "malformed record"),
    ("not a list", "malformed record"),
])
def test_untrainable_conversations_name_their_reason(turns, reason):
    with pytest.raises(BadConversation) as info:
        llava_messages(turns)
    assert info.value.reason == reason


@pytest.mark.parametrize("name", [*EXPECTED_REPLY, "tokenizer"])
def test_processor_template_renders_string_and_structured_messages_as_training(tokenizer, name):
    from megatron_ext.data.chat_template import processor_template

    template = resolve_chat_template(name, "en", tokenizer)[1]
    wrapped = processor_template(template, tokenizer)
    assert processor_template(wrapped, tokenizer) == wrapped
    structured = [{"role": m["role"], "content": ([{"type": "image"}] if "<image>" in m["content"] else [])
                   + [{"type": "text", "text": m["content"].replace("<image>\n", "")}]} for m in CONVERSATION]
    for messages, prompt in ((CONVERSATION, False), (CONVERSATION[:-1], True)):
        training = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=prompt)
        training_ids = tokenizer(training, add_special_tokens=needs_special_tokens(tokenizer, training)).input_ids
        for given in (messages, structured[:len(messages)]):
            rendered = tokenizer.apply_chat_template(given, chat_template=wrapped, tokenize=False, add_generation_prompt=prompt)
            # The tiny tokenizer adds its BOS (as Llama's does): the processor's template leaves it to
            # it, so `processor(text=rendered)` (HF's documented flow, lmms-eval's) gives training's ids.
            assert not rendered.startswith(tokenizer.bos_token)
            assert tokenizer(rendered).input_ids == training_ids
    image = tokenizer.convert_tokens_to_ids("<image>")
    ids, mask = ChatTokenizer(tokenizer, wrapped, image).encode(CONVERSATION)
    expected_ids, expected_mask = ChatTokenizer(tokenizer, template, image).encode(CONVERSATION)
    assert (ids == expected_ids).all() and (mask == expected_mask).all()
