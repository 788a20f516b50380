"""The tokens we train are the ones TRL and transformers train, on byte-level BPE tokenizers as
published models have: DPO's answer is TRL's completion as its DPOTrainer tokenizes a conversational
pair itself, with every bundled template; SFT's replies are what transformers' assistant mask marks
in TRL's training templates of the same chat formats. ChatML runs on a tokenizer as Qwen2's (its
special tokens, no BOS), the templates that render a BOS on one with a BOS (the tiny Llama's)."""

from __future__ import annotations

import pytest

from megatron_ext.data.chat_template import ChatTokenizer, resolve_chat_template, template_names

# The LLaVA fixture whose tokenizer each bundled template runs on.
TOKENIZER_OF = {name: "llava_qwen2_chatml" if name == "chatml" else "llava_clip" for name in template_names()}

PAIRS = [
    {"prompt": [{"role": "user", "content": "<image>\nWhat is in this image?"}],
     "chosen": [{"role": "assistant", "content": "A cat on a red sofa."}],
     "rejected": [{"role": "assistant", "content": "Two dogs."}]},
    {"prompt": [{"role": "user", "content": "Describe the picture."},
                {"role": "assistant", "content": "A bowl of fruit."},
                {"role": "user", "content": "How many apples?"}],
     "chosen": [{"role": "assistant", "content": "three"}],
     "rejected": [{"role": "assistant", "content": "Ten, and five bananas."}]},
]
CONVERSATION = [
    {"role": "user", "content": "<image>\nWhat is in the picture?"},
    {"role": "assistant", "content": "A red cat on a sofa."},
    {"role": "user", "content": "この画像には何が写っていますか？"},
    {"role": "assistant", "content": "赤いソファの上に猫が座っています。"},
]
# Our template, TRL's training template (with {% generation %} markers) of the same chat format, and
# what ends each reply in the span both train.
TRL_TRAINING = {"chatml": ("qwen2_5_vl_training_chat_template", "<|im_end|>\n"),
                "llama-3": ("llama3_training_chat_template", "<|eot_id|>"),
                "gemma": ("gemma_training_chat_template", "<end_of_turn>\n")}


@pytest.fixture
def llava_dir(request, name):
    return request.getfixturevalue(TOKENIZER_OF[name])


@pytest.fixture
def tokenizer(llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llava_dir)


def _chat(tokenizer, name):
    return ChatTokenizer(tokenizer, resolve_chat_template(name, "en", tokenizer)[1], tokenizer.convert_tokens_to_ids("<image>"))


def _trl_tokenized(llava_dir, template: str, rows: list[dict], kind: str) -> list[dict]:
    """`rows` as TRL's DPOTrainer (`kind` "dpo": prompt_ids, chosen_ids, rejected_ids) or SFTTrainer
    ("sft", prompt-completion rows: input_ids, labels: -100 where not trained) tokenizes them itself
    with `template`."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlavaForConditionalGeneration
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    trainer_class, config_class = {"dpo": (DPOTrainer, DPOConfig), "sft": (SFTTrainer, SFTConfig)}[kind]
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    tokenizer.chat_template = template
    with tempfile.TemporaryDirectory() as out:
        args = config_class(output_dir=out, report_to=[], use_cpu=True, bf16=False, max_length=None)
        trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        return list(trainer.train_dataset)


@pytest.mark.parametrize("name", template_names())
def test_dpo_sequences_and_completion_masks_equal_trl_own_tokenization(llava_dir, tokenizer, name):
    chat = _chat(tokenizer, name)
    for pair, trl in zip(PAIRS, _trl_tokenized(llava_dir, chat.template, PAIRS, "dpo")):
        for answer in ("chosen", "rejected"):
            ids, trained = chat.encode(pair["prompt"] + pair[answer], completion=True)
            assert ids.tolist() == trl["prompt_ids"] + trl[f"{answer}_ids"]
            assert trained.tolist() == [False] * len(trl["prompt_ids"]) + [True] * len(trl[f"{answer}_ids"])


@pytest.mark.parametrize("name", template_names())
def test_sft_on_a_single_turn_trains_trl_sft_completion(llava_dir, tokenizer, name):
    """TRL's SFTTrainer on prompt-completion rows trains the completion (its labels, completion_only_loss)."""
    chat = _chat(tokenizer, name)
    rows = [{"prompt": pair["prompt"], "completion": pair["chosen"]} for pair in PAIRS[:1]]
    for row, trl in zip(rows, _trl_tokenized(llava_dir, chat.template, rows, "sft")):
        ids, trained = chat.encode(row["prompt"] + row["completion"])
        assert ids.tolist() == trl["input_ids"]
        assert trained.tolist() == [label != -100 for label in trl["labels"]]


@pytest.mark.parametrize("name", ["chatml"])
def test_chatml_dpo_answer_ends_with_the_newline_after_im_end(tokenizer, name):
    ids, trained = _chat(tokenizer, "chatml").encode(PAIRS[1]["prompt"] + PAIRS[1]["chosen"], completion=True)
    assert tokenizer.convert_ids_to_tokens(ids[trained].tolist()) == ["three", "<|im_end|>", "Ċ"]


@pytest.mark.parametrize("name", sorted(TRL_TRAINING))
def test_sft_trains_what_transformers_assistant_mask_marks_in_trl_training_templates(tokenizer, name):
    from trl import chat_template_utils

    attribute, end = TRL_TRAINING[name]
    ids, trained = _chat(tokenizer, name).encode(CONVERSATION)
    hf = tokenizer.apply_chat_template(CONVERSATION, chat_template=getattr(chat_template_utils, attribute), tokenize=True,
                                       return_dict=True, return_assistant_tokens_mask=True)
    theirs = [i for i, m in zip(hf["input_ids"], hf["assistant_masks"]) if m]
    assert ids[trained].tolist() == theirs
    assert tokenizer.decode(theirs) == "".join(m["content"] + end for m in CONVERSATION if m["role"] == "assistant")
