"""Read whole Megatron tensors out of a dist checkpoint (torch_dist format, any TP/PP layout), a
few at a time, with torch.distributed.checkpoint alone (no megatron-core, no model, no process group).

megatron-core's load reads everything requested at once (and concatenates the gate/up halves of
a gated MLP again), and wants the whole model requested. Here each Megatron tensor is asked for
as what it is in the checkpoint, a chunk of a global tensor (see checkpoint.keys.chunk_of_tensor: a layer
tensor is one layer of a key stacked over layers), and read into memory of its own.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ext.checkpoint.keys import chunk_of_tensor, tensors_of_key
from megatron_ext.errors import UserError

Stored = dict[str, tuple[tuple[int, ...], torch.dtype]]


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads, for each key, the chunk at `offsets[key]` the size of the tensor given for it, into it."""

    def __init__(self, offsets: dict[str, tuple[int, ...]], snapshot_dir: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets
        self._dir = snapshot_dir

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, dest in self.state_dict.items():
            chunk = ChunkStorageMetadata(torch.Size(self._offsets[key]), dest.shape)
            reads = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            # The shapes come from the same metadata; what can still be wrong is a chunk no file holds.
            if sum(torch.Size(read.lengths).numel() for read in reads) != dest.numel():
                raise UserError(f"--megatron-dir {self._dir}: the checkpoint lacks parts of {key} (its files are incomplete)")
            items += reads
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the chunk itself, whatever its offsets in the global tensor


def by_layer(stored: Stored) -> list[Stored]:
    """The stored tensors, a layer (or one tensor outside the layers) at a time: the unit
    `SnapshotTensors.read` reads at once."""
    groups: dict[str, Stored] = {}
    for name, shape_dtype in stored.items():
        layer = re.match(r"^(.*\.decoder\.layers\.\d+)\.", name)
        groups.setdefault(layer.group(1) if layer else name, {})[name] = shape_dtype
    return list(groups.values())


class SnapshotTensors:
    """The tensors of one dist checkpoint, read a few at a time. Its metadata (every chunk of every
    key: megabytes at published depths) is unpickled once here, not again at each read, which
    torch's own reader would do."""

    def __init__(self, snapshot_dir: Path):
        self.dir = Path(snapshot_dir)
        try:
            self._metadata = FileSystemReader(str(self.dir)).read_metadata()
        except FileNotFoundError:
            raise UserError(f"--megatron-dir {self.dir} holds no dist checkpoint (no .metadata file)") from None

    def stored(self, prefixes: tuple[str, ...]) -> Stored:
        """{canonical Megatron name: (TP1 shape, dtype)} of every tensor stored under a key starting
        with one of `prefixes` (the model's; a trainer snapshot also holds its optimizer's)."""
        stored = {}
        for key, entry in self._metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata) and key.startswith(prefixes):
                stored.update({name: (shape, entry.properties.dtype) for name, shape in tensors_of_key(key, entry.size)})
        return stored

    def read(self, tensors: Stored) -> dict[str, torch.Tensor]:
        """{canonical name: (TP1 shape, dtype)} -> those whole Megatron tensors, read (in this
        process alone: no collective) into fresh memory. At most one tensor of each checkpoint key
        (the same tensor of every layer is one key): read a `by_layer` group at a time."""
        requests, offsets, out = {}, {}, {}
        for name, (shape, dtype) in tensors.items():
            key, key_offsets, sizes = chunk_of_tensor(name, shape)
            if key in requests:
                raise ValueError(f"{name} and another tensor asked for at once are both parts of {key}; "
                                 "read one layer at a time (by_layer)")
            offsets[key] = key_offsets
            requests[key] = torch.empty(sizes, dtype=dtype)
            out[name] = requests[key].view(shape)
        with warnings.catch_warnings():  # that it reads in this process alone: that is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp_load(requests, storage_reader=_ReaderOf(self.dir, self._metadata),
                     planner=_ChunkLoadPlanner(offsets, self.dir), no_dist=True)
        return out


class _ReaderOf(FileSystemReader):
    """torch's reader of the checkpoint in `path`, handed its metadata already read."""

    def __init__(self, path: Path, metadata):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        self._metadata.storage_meta.load_id = self.load_id  # as FileSystemReader's own sets it
        return self._metadata
