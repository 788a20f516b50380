"""Where things live in a Megatron checkpoint directory, and the metadata that rebuilds the model.

    ROOT/
      latest_checkpointed_iteration.txt   "release" (converted) or the latest iteration number
      release/ | iter_0000100/            one complete snapshot each:
        metadata.json, common.pt, *.distcp    megatron-core dist_checkpointing (torch_dist)
        megatron_ext.json                     our metadata (below)
        train_state/                          trainer state per rank (data position, RNG, ...)
      tokenizer/                          the HF tokenizer + processor, copied in
      hf_extra.safetensors                HF tensors LLaVA never uses (restored on the way back)

`megatron_ext.json` holds the HF LlavaConfig, the TP/PP layout and dtype the snapshot was
written with, its iteration, and (for trained snapshots) the trainer's resolved configuration:
a snapshot alone is enough to rebuild its model. A snapshot directory is written under a
temporary name and renamed when complete, and `latest_checkpointed_iteration.txt` is updated
last, so readers never see a half-written snapshot.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import UserError
from megatron_ext.fsutil import atomic_write_text

FORMAT = "megatron_ext/1"
METADATA_FILE = "megatron_ext.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
TOKENIZER_DIR = "tokenizer"
HF_EXTRA_FILE = "hf_extra.safetensors"
TRAIN_STATE_DIR = "train_state"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def snapshot_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


@dataclass(frozen=True)
class Snapshot:
    root: Path
    path: Path
    meta: dict

    @property
    def iteration(self) -> int:
        return int(self.meta.get("iteration", 0))

    @property
    def tp(self) -> int:
        return int(self.meta["parallel"]["tp"])

    @property
    def pp(self) -> int:
        return int(self.meta["parallel"]["pp"])

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def hf_config(self) -> dict:
        return self.meta["hf_config"]

    @property
    def run_config(self) -> dict:
        """The trainer's resolved run (`RunPlan.summary()`); empty for converted snapshots."""
        return self.meta.get("run_config") or {}

    @property
    def trainer_options(self) -> dict:
        """The trainer flags the snapshot was trained with (`TrainConfig` fields); empty if converted."""
        return self.run_config.get("config") or {}

    @property
    def lora_base(self) -> dict | None:
        """For an adapter checkpoint (a LoRA run's): the base checkpoint it applies to (path, fingerprint)."""
        return self.meta.get("lora_base")

    @property
    def arch(self):
        from megatron_ext.families import read_model

        return read_model(self.hf_config)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / TOKENIZER_DIR

    @property
    def hf_extra_file(self) -> Path:
        return self.root / HF_EXTRA_FILE

    @property
    def train_state_dir(self) -> Path:
        return self.path / TRAIN_STATE_DIR


def write_metadata(snapshot_dir: Path, *, kind: str, iteration: int, hf_config: dict, tp: int, pp: int,
                   dtype: str, has_optimizer: bool = False, run_config: dict | None = None,
                   lora_base: dict | None = None) -> dict:
    meta = {
        "format": FORMAT,
        "kind": kind,
        "iteration": iteration,
        "parallel": {"tp": tp, "pp": pp},
        "dtype": dtype,
        "has_optimizer": has_optimizer,
        "hf_config": hf_config,
        "run_config": run_config,
    }
    if lora_base is not None:
        meta["lora_base"] = lora_base
    (Path(snapshot_dir) / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return meta


def mark_latest(root: Path, iteration: int | str) -> None:
    atomic_write_text(Path(root) / LATEST_FILE, RELEASE if iteration == RELEASE else str(int(iteration)))


def list_snapshots(root: Path) -> list[int]:
    """Iterations of the complete `iter_*` snapshots under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _ITER_RE.match(child.name)
        if match and (child / METADATA_FILE).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def latest_complete_snapshot(root: Path, flag: str = "--save-dir") -> Snapshot | None:
    """The newest complete `iter_*` snapshot under `root` (None when there is none).

    Snapshots become visible by rename only when complete, so this is right even if a crash came
    between the rename and the update of latest_checkpointed_iteration.txt.
    """
    iterations = list_snapshots(root)
    return find_snapshot(Path(root) / snapshot_name(iterations[-1]), flag) if iterations else None


def _latest_name(root: Path) -> str | None:
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    value = latest.read_text().strip()
    return RELEASE if value == RELEASE else snapshot_name(int(value))


def find_snapshot(path: str | Path, flag: str = "--megatron-load-dir") -> Snapshot:
    """The snapshot `path` names: a checkpoint root (its latest snapshot) or a snapshot directory."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise UserError(f"{flag} {path} does not exist")
    if (path / METADATA_FILE).is_file():
        root, snap = path.parent, path
    else:
        name = _latest_name(path)
        if name is None:
            raise UserError(
                f"{flag} {path} is not a megatron_ext checkpoint (no {LATEST_FILE} or {METADATA_FILE}); "
                "create one with scripts/convert/convert_hf_to_megatron.py"
            )
        root, snap = path, path / name
        if not (snap / METADATA_FILE).is_file():
            raise UserError(f"{flag} {path}: {LATEST_FILE} names {name}, which is missing or incomplete")
    try:
        meta = json.loads((snap / METADATA_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: {snap / METADATA_FILE} is not valid JSON ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise UserError(f"{flag}: {snap / METADATA_FILE} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return Snapshot(root=root, path=snap, meta=meta)
