"""Hugging Face checkpoint directories, read and written one tensor at a time.

Reading: a single `model.safetensors` or a sharded `model.safetensors.index.json`; tensor names are
normalized (`mapping.normalize_hf_name`) and every read opens the file, copies one tensor out and
unmaps it, so a converter never holds more than the tensor it is working on.

Writing: `ShardWriter` is told every tensor's name, shape and dtype first, so it can write each
file's header before any data and then append every tensor as it comes: nothing is collected in
memory. Files hold at most a size limit and are named the way `transformers` does, with an index
when there is more than one.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import struct
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from megatron_ext.convert.mapping import normalize_hf_name
from megatron_ext.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# safetensors dtype codes -> ModelOptions dtype names.
_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# safetensors dtype codes <-> torch dtypes, for the files ShardWriter writes itself.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
# What makes up the model itself. Everything else in an HF directory (tokenizer, processor, chat
# template, generation config) describes the tokenizer side and travels with it.
_MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                "*.ckpt", "*.h5", "*.msgpack", CONFIG_FILE)
# A directory holds a tokenizer when one of these is present.
_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def read_config(hf_dir: Path, flag: str) -> dict:
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{flag} {hf_dir} has no {CONFIG_FILE}; give the directory of a Hugging Face LLaVA checkpoint")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: {path} is not valid JSON ({exc})") from exc


class HfWeights:
    """The tensors of an HF safetensors checkpoint, by normalized name (`normalize`: the model's
    `mapping.hf_name_of`; a LLaVA's by default)."""

    def __init__(self, hf_dir: str | Path, flag: str = "--hf-dir", normalize: Callable[[str], str] = normalize_hf_name):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self._where: dict[str, tuple[Path, str]] = {}
        self._dtypes: dict[str, str] = {}
        self._shapes: dict[str, list[int]] = {}
        self.nbytes = 0
        for file in self._files(flag):
            with safe_open(str(file), "pt") as f:
                for stored in f.keys():
                    name = normalize(stored)
                    if name in self._where:
                        raise UserError(f"{flag}: tensor {name} appears twice in {self.dir} (as {self._where[name][1]} and {stored})")
                    self._where[name] = (file, stored)
                    header = f.get_slice(stored)
                    self._dtypes[name], self._shapes[name] = header.get_dtype(), header.get_shape()
            self.nbytes += file.stat().st_size

    def _files(self, flag: str) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.dir / name for name in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise UserError(f"{flag}: {index} lists files that do not exist: {', '.join(missing)}")
            return files
        if (self.dir / WEIGHTS_FILE).is_file():
            return [self.dir / WEIGHTS_FILE]
        if any(self.dir.glob("*.bin")):
            raise UserError(f"{flag} {self.dir} holds PyTorch .bin weights; re-save it as safetensors "
                            "(LlavaForConditionalGeneration.from_pretrained(d).save_pretrained(d2))")
        raise UserError(f"{flag} {self.dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file, stored = self._where[name]
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(stored)

    def meta(self, name: str) -> torch.Tensor:
        """A stand-in with the tensor's shape and no data (on the meta device): for checking shapes
        before anything is read. Its dtype is float32 whatever is stored, as shapes do not depend on it."""
        return torch.empty(self._shapes[name], device="meta")

    def dtype(self, flag: str = "--hf-dir") -> str:
        """The one floating-point dtype of the weights, as a ModelOptions dtype name."""
        found = {code for code in self._dtypes.values() if code.startswith(("F", "BF"))}
        unsupported = found - set(_FLOAT_DTYPES)
        if unsupported:
            raise UserError(f"{flag}: weights of dtype {', '.join(sorted(unsupported))} are not supported "
                            f"(supported: {', '.join(_FLOAT_DTYPES.values())})")
        if len(found) != 1:
            raise UserError(f"{flag}: the weights mix dtypes ({', '.join(sorted(found))}); Megatron holds one dtype, "
                            "so the conversion could not be exact. Re-save the model in one dtype first")
        return _FLOAT_DTYPES[found.pop()]


def meta_hf_model(hf_config: dict):
    """transformers' model for this config (a LLaVA's or a vision-language family's), on the meta
    device (names and shapes, no memory)."""
    import transformers

    from megatron_ext.families import model_kind

    kind = model_kind(hf_config)
    with torch.device("meta"):
        return getattr(transformers, kind.model_class)(getattr(transformers, kind.config_class).from_dict(hf_config))


def hf_model_names(hf_config: dict) -> list[str]:
    """The tensor names `transformers` saves for this config (tied copies once), normalized."""
    from megatron_ext.convert.mapping import hf_name_of
    from megatron_ext.families import read_model

    model = meta_hf_model(hf_config)
    normalize = hf_name_of(read_model(hf_config))
    unique = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
    return [normalize(name) for name in model.state_dict() if name not in tied]


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * torch.Size(self.shape).numel()


class ShardWriter:
    """Writes the `planned` tensors, given one at a time in that order, into safetensors files of
    at most `max_shard_size` bytes (a larger tensor gets a file of its own).

    The writing happens on a thread, one tensor behind the caller, so reading and converting the
    next tensor overlap with writing this one (file writes release the GIL); at most two tensors
    are held."""

    def __init__(self, out_dir: Path, max_shard_size: int, planned: list[TensorSpec]):
        from concurrent.futures import ThreadPoolExecutor

        self.out_dir = Path(out_dir)
        shards, size = [[]], 0
        for spec in planned:
            if shards[-1] and size + spec.nbytes > max_shard_size:
                shards, size = shards + [[]], 0
            shards[-1].append(spec)
            size += spec.nbytes
        count = len(shards)
        files = [WEIGHTS_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._shards = dict(zip(files, shards))
        self._next = ((file, i, spec) for file, specs in self._shards.items() for i, spec in enumerate(specs))
        self._stream = None
        self._thread = ThreadPoolExecutor(max_workers=1)
        self._writing = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file, position, spec = next(self._next, (None, None, None))
        if spec is None or (name, tuple(tensor.shape), tensor.dtype) != (spec.name, tuple(spec.shape), spec.dtype):
            raise RuntimeError(f"ShardWriter: got {name} {list(tensor.shape)} {tensor.dtype}, planned {spec}")
        # The tensor's bytes as they are in memory (little-endian, as safetensors stores them).
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._wait()
        self._writing = self._thread.submit(self._write, file, position, data)

    def _wait(self) -> None:
        if self._writing is not None:
            self._writing.result()  # raises here what the write raised

    def _write(self, file: str, position: int, data) -> None:
        if position == 0:
            self._open(file)
        self._stream.write(data.data)
        if position == len(self._shards[file]) - 1:
            self._stream.close()

    def _open(self, file: str) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for spec in self._shards[file]:
            header[spec.name] = {"dtype": _SAFETENSORS_CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._stream = open(self.out_dir / file, "wb")
        self._stream.write(struct.pack("<Q", len(raw)) + raw)

    def close(self) -> None:
        """Wait for the writes, check that every planned tensor came; write the index when there is more than one file."""
        self._wait()
        self._thread.shutdown()
        left = next(self._next, None)
        if left is not None:
            raise RuntimeError(f"ShardWriter: {left[2].name} and maybe more were planned but never given")
        if len(self._shards) > 1:
            weight_map = {spec.name: file for file, specs in self._shards.items() for spec in specs}
            total = sum(spec.nbytes for specs in self._shards.values() for spec in specs)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def check_tokenizer_dir(path: Path, flag: str) -> Path:
    path = Path(path).expanduser().resolve()
    if not path.is_dir() or not any((path / marker).is_file() for marker in _TOKENIZER_MARKERS):
        raise UserError(f"{flag} {path} holds no tokenizer (none of {', '.join(_TOKENIZER_MARKERS)}); "
                        "give the directory of the HF model or its tokenizer")
    return path


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer, processor, chat template and generation config of an HF directory."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(Path(src).iterdir()):
        if file.is_file() and not any(fnmatch.fnmatch(file.name, pattern) for pattern in _MODEL_FILES):
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied
