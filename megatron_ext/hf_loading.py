"""Loading Hugging Face pieces with one-line errors that name the flag and the path."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.errors import UserError


def _describe(source: str) -> str:
    if Path(source).expanduser().exists():
        return f"local path {source}"
    return f"{source!r} (not a local directory; tried as a Hugging Face Hub tag)"


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or source.count("/") > 1


def _load(what: str, loader, source: str, flag: str, **kwargs):
    if _looks_like_path(source) and not Path(source).expanduser().exists():
        raise UserError(f"{flag} {source} does not exist (give a local directory or a Hub tag like org/name)")
    try:
        return loader(str(Path(source).expanduser()) if Path(source).expanduser().exists() else source, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{flag}: cannot load the {what} from {_describe(source)}: {reason}") from exc


def load_with(loader, what: str, source: str, flag: str, **kwargs):
    """`loader(source)` (a from_pretrained) with the errors of the other loaders here."""
    return _load(what, loader, source, flag, **kwargs)


def load_config(source: str, flag: str):
    from transformers import AutoConfig

    return _load("model config", AutoConfig.from_pretrained, source, flag)


def load_tokenizer(source: str, flag: str):
    from transformers import AutoTokenizer

    return _load("tokenizer", AutoTokenizer.from_pretrained, source, flag)


def load_image_processor(source: str, flag: str):
    """The PIL-backend image processor, the one the data path reproduces bit for bit; where
    torchvision is installed transformers would pick its torchvision one, whose resize differs by
    a few levels."""
    from transformers import AutoImageProcessor

    return _load("image processor", AutoImageProcessor.from_pretrained, source, flag, backend="pil")


def load_processor(source: str, flag: str):
    from transformers import AutoProcessor

    return _load("processor", AutoProcessor.from_pretrained, source, flag)


def load_pretrained(model_cls, source: str, flag: str, **kwargs):
    return _load(f"{model_cls.__name__} weights", model_cls.from_pretrained, source, flag, **kwargs)

