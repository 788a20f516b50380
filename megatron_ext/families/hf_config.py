"""Reading Hugging Face configs, given as transformers config objects or config.json dicts."""

from __future__ import annotations

from typing import Any


def get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def as_dict(cfg: Any) -> dict:
    return cfg if isinstance(cfg, dict) else cfg.to_dict()
