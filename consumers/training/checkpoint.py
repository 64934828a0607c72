"""Training checkpoints, committed atomically: weights the inference server can reload, optimizer
and RNG state, the consumed Kafka offsets, and a manifest of the records each step covered.

Layout of a checkpoint root (``TrainerSettings.checkpoint_dir``)::

    latest                          "step-00000012": the committed checkpoint (the commit point)
    step-00000012/
        model/                      save_pretrained: config.json, model.safetensors, tokenizer
        trainer.pt                  optimizer state, RNG states (torch.save; our own file)
        meta.json                   step, policy version, offsets, counters, metrics, manifest
        trained_ids.npy             the trainer's window of recently trained sample ids
                                    (batching.TrainedIds keys, uint64, oldest first)
    manifests/step-00000012.json    the (partition, offset) records step 12 trained / dropped,
                                    and the sample ids it trained, in the order it trained them
    .tmp-step-00000013-k2j4/        a write in progress, or left by a crash

``CheckpointStore.save`` commits in this order:
    1. write model/, trainer.pt, meta.json into a fresh temp dir in the root; fsync them
    2. rename the temp dir to step-N (atomic within one file system); fsync the root
    3. write manifests/step-N.json (temp file + os.replace)
    4. write ``latest`` (temp file + os.replace): from here on step N is committed
    5. prune: step dirs beyond the newest ``keep`` are renamed away, then deleted
A crash anywhere before 4 leaves ``latest`` on step N - 1, a complete checkpoint. Opening the
store (``recover``) removes what an interrupted save left: temp dirs, and step dirs and manifests
newer than ``latest``. So the manifests on disk are exactly those of the committed steps, and
their union is the set of records the committed model has seen (``manifests``).

``CheckpointStore.commit_drops`` commits records that no step trains (all stale, duplicates,
dead letters) over the latest step without a new step: the weights, optimizer, RNG states and
duplicate window are unchanged, so only ``meta.json`` is replaced (temp file + os.replace: the
commit point), with offsets past those records, the counters, the manifest extended and
``drop_commits`` + 1; then ``manifests/step-N.json``. ``recover`` rewrites the latest manifest
from its ``meta.json`` when a crash came between the two.

The model dir is a plain transformers checkpoint (``AutoModelForCausalLM.from_pretrained`` and
the reference server's ``/v1/load_weights`` read it; so does vLLM when the tokenizer files of
the base model are copied in, which ``save`` does with ``copy_from``).

``trainer.pt`` holds tensors, plain Python values and the RNG states (numpy's as a tensor), so
it is read with ``torch.load(weights_only=True)``: loading a checkpoint runs no pickled code.
Files written before numpy's state was stored as a tensor are read with numpy's array
reconstruction allowed, and nothing else.

Reading without a store (``read_checkpoint``, ``read_manifests``) opens nothing for writing: a
retrain reads another run's checkpoints this way (opening a ``CheckpointStore`` recovers, and so
may delete, what an interrupted save left).

Errors: ``CheckpointError`` (rollstream.consumers.errors): a root that is not a consistent
store, a checkpoint that does not fit the model.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rollstream.consumers.errors import CheckpointError

__all__ = [
    "LATEST",
    "TRAINED_IDS",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointStore",
    "Manifest",
    "load_trainer_state",
    "load_weights",
    "read_checkpoint",
    "read_manifests",
    "rng_state",
    "set_rng_state",
]

LATEST = "latest"
TRAINED_IDS = "trained_ids.npy"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WRITTEN_BY_SAVE = {"config.json", "generation_config.json", "rollstream.json"}


@dataclass(slots=True)
class Manifest:
    """The records one step covered, as (partition, offset) pairs of ``topic``: ``trained``
    went into the gradient, ``stale`` were dropped by the staleness filter, ``dlq`` were sent to
    the dead-letter topic, ``duplicate`` carried a sample_id trained before (dropped),
    ``skipped`` were in no step of the manifests a trainer followed (``train_follow``).
    Together they are every record between two checkpoints' offsets (a following trainer's
    offsets stop before the records it still holds for a later step).

    ``trained_ids``: the sample ids of ``trained``, in the order the step put them into its
    batch. Coordinates belong to one topic; ids are the same in any namespace the samples are
    rebuilt in, so a retrain follows a step by its ids (empty in manifests written before)."""

    topic: str
    trained: list[tuple[int, int]] = field(default_factory=list)
    stale: list[tuple[int, int]] = field(default_factory=list)
    dlq: list[tuple[int, int]] = field(default_factory=list)
    duplicate: list[tuple[int, int]] = field(default_factory=list)
    trained_ids: list[str] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "trained": [list(x) for x in self.trained],
            "stale": [list(x) for x in self.stale],
            "dlq": [list(x) for x in self.dlq],
            "duplicate": [list(x) for x in self.duplicate],
            "trained_ids": list(self.trained_ids),
            "skipped": [list(x) for x in self.skipped],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        def pairs(key: str) -> list[tuple[int, int]]:
            return [(int(p), int(o)) for p, o in data.get(key, [])]

        return cls(
            str(data["topic"]),
            pairs("trained"),
            pairs("stale"),
            pairs("dlq"),
            pairs("duplicate"),
            [str(x) for x in data.get("trained_ids", [])],
            pairs("skipped"),
        )


@dataclass(slots=True)
class CheckpointMeta:
    """What a checkpoint records besides tensors. ``offsets[topic][partition]`` is the next
    offset to read: every record before it is covered by this or an earlier step."""

    step: int
    policy_version: int
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    samples_trained: int = 0
    tokens_trained: int = 0
    counters: dict[str, float] = field(default_factory=dict)  # cumulative: stale, dlq, ...
    metrics: dict[str, float] = field(default_factory=dict)  # of this step
    manifest: Manifest | None = None
    base_model: str = ""
    ts: int = 0  # microseconds since the epoch
    # the trainer settings that decide what a step computes (TrainerSettings.train_config())
    train_config: dict[str, Any] = field(default_factory=dict)
    drop_commits: int = 0  # drop-only commits over this step (CheckpointStore.commit_drops)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["offsets"] = {t: {str(p): o for p, o in ps.items()} for t, ps in self.offsets.items()}
        data["manifest"] = None if self.manifest is None else self.manifest.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointMeta:
        manifest = data.get("manifest")
        return cls(
            step=int(data["step"]),
            policy_version=int(data["policy_version"]),
            offsets={
                t: {int(p): int(o) for p, o in ps.items()}
                for t, ps in data.get("offsets", {}).items()
            },
            samples_trained=int(data.get("samples_trained", 0)),
            tokens_trained=int(data.get("tokens_trained", 0)),
            counters={k: float(v) for k, v in data.get("counters", {}).items()},
            metrics={k: float(v) for k, v in data.get("metrics", {}).items()},
            manifest=None if manifest is None else Manifest.from_json(manifest),
            base_model=str(data.get("base_model", "")),
            ts=int(data.get("ts", 0)),
            train_config=dict(data.get("train_config", {})),
            drop_commits=int(data.get("drop_commits", 0)),
        )


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A committed checkpoint on disk."""

    path: Path
    meta: CheckpointMeta

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def model_dir(self) -> Path:
        """The weights as a transformers checkpoint dir: the PolicyVersion checkpoint_uri."""
        return self.path / "model"


# ---- files ------------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_atomic(path: Path, text: str, *, fsync: bool) -> None:
    """Write ``text`` to ``path`` so a reader sees the old or the new content, never a mix."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_path(path.parent)


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


# ---- RNG and weights --------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: python, numpy, torch CPU and CUDA. Numpy's
    MT19937 keys are stored as an int64 tensor, so the state loads with ``weights_only``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (
            str(kind),
            torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    np.random.set_state((kind, keys, *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_model(model: nn.Module, out: Path) -> None:
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(out)
        return
    from safetensors.torch import save_model

    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"))


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Load every ``*.safetensors`` file of ``model_dir`` into ``model`` in place. Keys missing
    from the files are allowed only for tensors tied to one that is present (save_pretrained
    writes a tied lm_head once); anything else raises CheckpointError."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    current = model.state_dict()
    unexpected = sorted(k for k in state if k not in current)
    present = {current[k].data_ptr() for k in state if k in current}
    missing = sorted(k for k in current if k not in state and current[k].data_ptr() not in present)
    if unexpected or missing:
        raise CheckpointError(
            f"weights in {model_dir} do not fit the model: "
            f"missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise CheckpointError(f"weights in {model_dir} do not fit the model: {exc}") from exc


def load_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer.pt`` (optimizer and RNG state) with ``weights_only=True``. A file whose numpy
    RNG state is an array (written before it was stored as a tensor) is read with numpy's
    array reconstruction allowed, and nothing more."""
    import pickle

    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        return state
    except pickle.UnpicklingError:
        pass
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 / 1
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("<u4"))]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds objects a weights-only load refuses: {exc}") from exc
    return state


def read_checkpoint(path: Path) -> Checkpoint:
    """The committed checkpoint in step dir ``path``, read only (no store opened)."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json)")
    try:
        meta = CheckpointMeta.from_json(json.loads(meta_file.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{meta_file} is not valid checkpoint metadata: {exc}") from exc
    return Checkpoint(path, meta)


def read_manifests(root: Path) -> list[tuple[int, Manifest]]:
    """(step, manifest) of every step manifest under ``root/manifests``, ascending by step,
    read only. On a store another process may be writing, call it after ``latest`` was read
    and ignore steps past it (``CheckpointStore.manifests`` on an opened store has none)."""
    out: list[tuple[int, Manifest]] = []
    folder = Path(root) / "manifests"
    if not folder.is_dir():
        return out
    for f in folder.glob("step-*.json"):
        m = _STEP_DIR.match(f.stem)
        if m:
            try:
                manifest = Manifest.from_json(json.loads(f.read_text()))
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{f} is not a valid manifest: {exc}") from exc
            out.append((int(m.group(1)), manifest))
    return sorted(out, key=lambda x: x[0])


# ---- the store --------------------------------------------------------------------------------


class CheckpointStore:
    """Checkpoints under ``root``: ``save`` commits one atomically (see the module docstring),
    ``latest`` returns the committed one, ``restore`` loads it into a model and optimizer.

    Opening the store recovers from an interrupted save (``recovered`` lists what was removed).
    One writer per root: two trainers must not share a checkpoint dir."""

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 3, fsync: bool = True):
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(exist_ok=True)
        self.recovered = self.recover()

    # -- reading

    def _latest_name(self) -> str | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        if not _STEP_DIR.match(name):
            raise CheckpointError(f"{pointer} holds {name!r}, not a step dir name")
        return name

    def steps(self) -> list[int]:
        """Steps whose dirs are on disk (committed ones after ``recover``), ascending."""
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Checkpoint | None:
        """The committed checkpoint, or None when nothing was ever committed."""
        name = self._latest_name()
        if name is None:
            return None
        return self.load(self.root / name)

    def load(self, path: Path) -> Checkpoint:
        return read_checkpoint(path)

    def manifests(self) -> list[tuple[int, Manifest]]:
        """(step, manifest) of every committed step still on record, ascending by step."""
        return read_manifests(self.root)

    # -- recovery

    def recover(self) -> list[str]:
        """Remove what an interrupted save or prune left behind; return the names removed."""
        latest = self._latest_name()
        if latest is not None and not (self.root / latest / "meta.json").is_file():
            raise CheckpointError(f"{self.root / LATEST} points to a missing checkpoint {latest}")
        last = -1 if latest is None else int(latest.removeprefix("step-"))
        removed: list[str] = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            junk = p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) or (
                m is not None and int(m.group(1)) > last
            )
            if junk:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(p.name)
        for f in (self.root / "manifests").iterdir():
            m = _STEP_DIR.match(f.stem)
            if f.name.startswith(_TMP_PREFIX) or (m is not None and int(m.group(1)) > last):
                f.unlink()
                removed.append(f"manifests/{f.name}")
        if latest is not None:
            removed += self._recover_drops(self.root / latest)
        self._prune(last)
        return removed

    def _recover_drops(self, path: Path) -> list[str]:
        """After a crash in ``commit_drops``: remove its temp file, and write the manifest of
        the committed ``meta.json`` when the manifest file is not that one."""
        removed = []
        for f in path.glob(_TMP_PREFIX + "*"):
            f.unlink()
            removed.append(f"{path.name}/{f.name}")
        manifest = read_checkpoint(path).meta.manifest
        if manifest is None:
            return removed
        manifest_file = self.root / "manifests" / f"{path.name}.json"
        try:
            on_disk = json.loads(manifest_file.read_text())
        except (OSError, ValueError):
            on_disk = None
        if on_disk != manifest.to_json():
            _write_atomic(manifest_file, json.dumps(manifest.to_json()), fsync=self.fsync)
            removed.append(f"manifests/{manifest_file.name} (rewritten from {path.name})")
        return removed

    def _prune(self, last: int) -> None:
        committed = [s for s in self.steps() if s <= last]
        for step in committed[: -self.keep]:
            src = self.root / _step_name(step)
            trash = self.root / f"{_TRASH_PREFIX}{src.name}"
            src.rename(trash)  # atomic: a crash never leaves a half-deleted step dir
            shutil.rmtree(trash)

    # -- writing

    def save(
        self,
        meta: CheckpointMeta,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        copy_from: Path | None = None,
        before_commit: Callable[[Path], None] | None = None,
        trained_ids: np.ndarray | None = None,
    ) -> Checkpoint:
        """Write and commit the checkpoint of ``meta.step`` (see the module docstring).

        copy_from: a model dir whose tokenizer and other non-weight files are copied into the
        checkpoint's model dir. before_commit(temp_dir) runs when everything is written but not
        yet renamed (a debug hook: the trainer pauses there for crash tests). trained_ids: the
        keys of the trainer's duplicate window (``TrainedIds.keys()``), committed with the
        step."""
        name = _step_name(meta.step)
        if (self.root / name).exists():
            raise CheckpointError(f"{self.root / name} exists: step {meta.step} was committed")
        meta.ts = meta.ts or time.time_ns() // 1000
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=self.root))
        try:
            model_dir = tmp / "model"
            _save_model(model, model_dir)
            if copy_from is not None:
                _copy_support_files(copy_from, model_dir)
            info = {"policy_version": meta.policy_version, "trainer_step": meta.step}
            (model_dir / "rollstream.json").write_text(json.dumps(info))
            torch.save(
                {
                    "optimizer": None if optimizer is None else optimizer.state_dict(),
                    "rng": rng_state(),
                },
                tmp / "trainer.pt",
            )
            (tmp / "meta.json").write_text(json.dumps(meta.to_json()))
            if trained_ids is not None:
                np.save(tmp / TRAINED_IDS, np.ascontiguousarray(trained_ids, dtype=np.uint64))
            if self.fsync:
                _fsync_tree(tmp)
            if before_commit is not None:
                before_commit(tmp)
            tmp.rename(self.root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.fsync:
            _fsync_path(self.root)
        if meta.manifest is not None:
            manifest_file = self.root / "manifests" / f"{name}.json"
            _write_atomic(manifest_file, json.dumps(meta.manifest.to_json()), fsync=self.fsync)
        _write_atomic(self.root / LATEST, name + "\n", fsync=self.fsync)  # the commit point
        self._prune(meta.step)
        return Checkpoint(self.root / name, meta)

    def commit_drops(self, meta: CheckpointMeta) -> Checkpoint:
        """Commit ``meta`` over the latest checkpoint, of the same step, without a new step
        (see the module docstring): a drop-only commit of records no step trained. ``meta``
        differs from the latest's in offsets, counters, manifest and ``drop_commits`` only;
        the weights and the rest of the step dir stay as they are."""
        name = self._latest_name()
        if name != _step_name(meta.step):
            raise CheckpointError(
                f"a drop-only commit of step {meta.step} needs it to be the latest ({name})"
            )
        path = self.root / name
        _write_atomic(path / "meta.json", json.dumps(meta.to_json()), fsync=self.fsync)
        if meta.manifest is not None:  # after a crash before this, recover writes it
            manifest_file = self.root / "manifests" / f"{name}.json"
            _write_atomic(manifest_file, json.dumps(meta.manifest.to_json()), fsync=self.fsync)
        return Checkpoint(path, meta)

    def trained_ids(self, checkpoint: Checkpoint) -> np.ndarray:
        """The keys of the duplicate window committed with ``checkpoint`` (uint64, oldest
        first); empty for a checkpoint written without one."""
        path = checkpoint.path / TRAINED_IDS
        if not path.is_file():
            return np.zeros(0, np.uint64)
        try:
            keys = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a trained-ids file: {exc}") from exc
        if keys.dtype != np.uint64 or keys.ndim != 1:
            raise CheckpointError(f"{path} holds {keys.dtype} {keys.shape}, not uint64 (n,)")
        return keys

    def restore(
        self,
        checkpoint: Checkpoint,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        restore_rng: bool = True,
    ) -> CheckpointMeta:
        """Load the checkpoint's weights (and optimizer and RNG state) in place."""
        load_weights(model, checkpoint.model_dir)
        state = load_trainer_state(checkpoint.path / "trainer.pt")
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        if restore_rng:
            set_rng_state(state["rng"])
        return checkpoint.meta


def _copy_support_files(src: Path, dst: Path) -> None:
    """Copy tokenizer files and the like (everything but weights and files save writes)."""
    files: Iterable[Path] = (p for p in src.iterdir() if p.is_file())
    for f in files:
        if (
            f.suffix in _WEIGHT_SUFFIXES
            or f.name in _WRITTEN_BY_SAVE
            or f.name.endswith(".index.json")
        ):
            continue
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
