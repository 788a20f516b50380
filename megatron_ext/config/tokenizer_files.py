"""Image and pad token ids read straight from a tokenizer's JSON files (no transformers import).

Tokens added by build_llava (`<image>`, and `<pad>` when the text model had no pad token) are in
tokenizer.json's `added_tokens` (and, for tokenizers saved by transformers 4, in
tokenizer_config.json's `added_tokens_decoder`); the pad token is named by tokenizer_config.json
or special_tokens_map.json and may also be an ordinary vocabulary entry.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ext.errors import UserError
from megatron_ext.families.llava import IMAGE_TOKEN

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else ""
    except OSError as exc:
        raise UserError(f"{flag}: cannot read {path} ({exc})") from None


def _parse_json(text: str, path: Path, flag: str) -> dict:
    try:
        return json.loads(text) if text else {}
    except ValueError as exc:
        raise UserError(f"{flag}: {path} is not valid JSON ({exc})") from None


def _content(token) -> str | None:
    """A special-token entry is a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


class TokenizerFiles:
    """The parts of a Hugging Face tokenizer directory that map token strings to ids."""

    def __init__(self, directory: str | Path, flag: str = "--tokenizer-load-dir"):
        self.directory = Path(directory)
        self.flag = flag
        if not self.directory.is_dir():
            raise UserError(f"{flag} {self.directory} is not a directory; pass the HF LLaVA directory")
        if not any((self.directory / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"{flag} {self.directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
                            "pass the HF LLaVA directory written by build_llava_jp.py")
        self._tokenizer_text = _read_text(self.directory / "tokenizer.json", flag)
        self._tokenizer: dict | None = None
        self.config = self._json("tokenizer_config.json")
        self.special_map = self._json("special_tokens_map.json")

    def _json(self, name: str) -> dict:
        return _parse_json(_read_text(self.directory / name, self.flag), self.directory / name, self.flag)

    @property
    def tokenizer(self) -> dict:
        """tokenizer.json, parsed when first needed (a large vocabulary takes ~0.1 s)."""
        if self._tokenizer is None:
            self._tokenizer = _parse_json(self._tokenizer_text, self.directory / "tokenizer.json", self.flag)
        return self._tokenizer

    def added_tokens(self) -> list[dict]:
        """tokenizer.json's `added_tokens`, decoded alone: the tokenizers library writes that list before the
        vocabulary, so the special tokens are found without parsing megabytes of vocabulary."""
        key = self._tokenizer_text.find('"added_tokens"')
        start = self._tokenizer_text.find("[", key) if key >= 0 else -1
        if start >= 0:
            try:
                tokens, _ = json.JSONDecoder().raw_decode(self._tokenizer_text, start)
                if all(isinstance(t, dict) and "id" in t and "content" in t for t in tokens):
                    return tokens
            except ValueError:
                pass
        return self.tokenizer.get("added_tokens", [])

    def token_id(self, content: str) -> int | None:
        for token in self.added_tokens():
            if token.get("content") == content:
                return int(token["id"])
        for token_id, token in self.config.get("added_tokens_decoder", {}).items():
            if _content(token) == content:
                return int(token_id)
        vocab = self.tokenizer.get("model", {}).get("vocab")
        if isinstance(vocab, dict) and content in vocab:
            return int(vocab[content])
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
            return next((i for i, entry in enumerate(vocab) if entry and entry[0] == content), None)
        return None

    def pad_token(self) -> str | None:
        return _content(self.config.get("pad_token")) or _content(self.special_map.get("pad_token"))

    def image_token_id(self, token: str = IMAGE_TOKEN) -> int:
        token_id = self.token_id(token)
        if token_id is None:
            raise UserError(f"{self.flag} {self.directory} has no {token} token; build the model with "
                            "build_llava_jp.py or pass --image-token-id")
        return token_id

    def pad_token_id(self) -> int:
        pad = self.pad_token()
        token_id = self.token_id(pad) if pad else None
        if token_id is None:
            raise UserError(f"{self.flag} {self.directory} has no pad token id ({pad or 'no pad_token set'}); "
                            "pass --pad-token-id")
        return token_id
