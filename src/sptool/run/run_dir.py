"""The run directory: manifest, step outputs, resume checks and clean-up of partial files.

Layout::

    config.toml             the effective configuration
    manifest.json           finished steps: output file, record count, sha256, metrics (atomic)
    metrics.jsonl           one line per finished step (rebuilt from the manifest, atomic)
    iter-0001/NN-STEP.jsonl each step's output (atomic); .rejects.jsonl: dropped records;
                            NN-STEP.NAME.json: a document the step saved (WIST's tree)
    NAME.json               the latest saved document of each name
    ckpt/ROLE/step-N/       checkpoints

Every file is written through :mod:`sptool.core.jsonl`'s atomic writers (temp file + rename), so a
killed run leaves only ``.part`` temp files, removed when it resumes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from sptool.core.jsonl import AtomicJsonlWriter, write_json_atomic
from sptool.core.records import InputError, RuntimeFailure, UsageError

MANIFEST = "manifest.json"
LOCK = ".lock"
_HELD: dict[str, Any] = {}  # run directories this process has locked (held until it exits)
FORMAT = 1


class StepKey(str):
    """A step's key, ``iter-0003/07-s1-rollout``: its iteration, its place in the iteration's plan
    and its name. It is the string (manifest keys, file names), with the three parts parsed once."""

    iteration: int
    index: int
    name: str

    def __new__(cls, iteration: int, index: int, name: str) -> "StepKey":
        key = super().__new__(cls, f"iter-{iteration:04d}/{index:02d}-{name}")
        key.iteration, key.index, key.name = iteration, index, name
        return key

    @classmethod
    def parse(cls, key: str) -> "StepKey":
        if isinstance(key, StepKey):
            return key
        folder, _, stem = key.partition("/")
        index, _, name = stem.partition("-")
        return cls(int(folder.split("-", 1)[1]), int(index), name)

    @property
    def folder(self) -> str:
        """``iter-0003``"""
        return self.split("/", 1)[0]

    @property
    def stem(self) -> str:
        """``07-s1-rollout`` (the output file's name without ``.jsonl``)."""
        return self.split("/", 1)[1]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_jsonl(path: Path) -> list[dict]:
    """A run file's records; a corrupt line is one error naming ``path:line`` (exit 1)."""
    from sptool.core.jsonl import decode_json, iter_lines

    records = []
    try:
        with open(path, "rb") as handle:
            for number, line in iter_lines(handle, str(path)):
                if line.strip():
                    records.append(decode_json(line, source=str(path), line=number))
    except InputError as error:
        raise RuntimeFailure(f"{error.message}: corrupt run file; restore it or start a new "
                             "--run-dir") from None
    return records


def write_jsonl(path: Path, records: Iterable[dict], before_rename: Callable[[], None] | None = None,
                lines: list[str] | None = None) -> None:
    """Write ``records`` atomically; ``before_rename`` runs once they are written (a test hook);
    ``lines``, when given, gets each record's line as written."""
    with AtomicJsonlWriter(path) as writer:
        for record in records:
            line = writer.write(record)
            if lines is not None:
                lines.append(line)
        if before_rename is not None:
            before_rename()


def changed_keys(config: dict, saved: dict, defaults: dict) -> list[str]:
    """``section.key`` names whose value differs from the saved run's (a key newer than the run,
    absent from its saved configuration, counts as its default)."""
    return sorted(f"{s}.{k}" for s in config if isinstance(config[s], dict) for k in config[s]
                  if saved.get(s, {}).get(k, defaults.get(s, {}).get(k)) != config[s][k])


def resumable_change(key: str) -> bool:
    """Keys a resumed run may change: more iterations, and the curriculum-health alarms (a run
    stopped by one continues after raising its threshold), and the garbage collector's freezing."""
    return key in ("run.iterations", "run.stop_on_collapse", "run.gc_freeze") \
        or key.startswith(("health.min_", "health.max_"))


class RunDir:
    """One run's directory and its manifest (``order``: finished step keys; ``stages``: entries)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest: dict = {}
        self._lock = None
        self._prune: dict[str, tuple[int, Callable[[Path], bool]]] = {}  # role -> (keep, complete)
        self._prune_lock = threading.RLock()

    def lock(self) -> None:
        """Hold ``.lock`` in the run directory for this process's lifetime: a second ``sptool run``
        (two ``--resume``s) on the same directory is refused. The kernel drops the lock when the
        process dies, even by SIGKILL, so a killed run can always be resumed."""
        import fcntl

        if self._lock is not None:
            return
        key = os.path.realpath(self.path)
        if key in _HELD:  # this process holds it already (one process, several RunDir objects)
            self._lock = _HELD[key]
            return
        handle = open(self.path / LOCK, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise UsageError(f"run directory {self.path} is in use by another sptool run "
                             f"(pid {owner}); wait for it or stop it first") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._lock = _HELD[key] = handle

    def prepare(self, config: dict, *, resume: bool, defaults: dict, config_text: Callable[[], str]) -> bool:
        """Create a new run directory, or open one to resume; returns whether it resumes."""
        recipe = config["recipe"]
        manifest_path = self.path / MANIFEST
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"--run-dir {self.path} is a file, not a directory; choose another --run-dir")
        if resume:
            if manifest_path.is_file():
                self.lock()
                self._open(config, defaults)
                return True
            if self.path.exists() and any(p.name != LOCK for p in self.path.iterdir()):
                raise UsageError(f"--resume: {self.path} has no {MANIFEST}; not a run directory")
        elif self.path.exists() and any(p.name != LOCK for p in self.path.iterdir()):
            raise UsageError(f"run directory {self.path} is not empty; use --resume to continue "
                             f"it or choose another --run-dir")
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock()
        (self.path / "config.toml").write_text(config_text(), encoding="utf-8")
        self.manifest = {"format": FORMAT, "recipe": recipe, "config": config,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}, "order": []}
        self.save()
        return False

    def _open(self, config: dict, defaults: dict) -> None:
        recipe = config["recipe"]
        try:
            from sptool.core.jsonl import loads_strict

            self.manifest = loads_strict((self.path / MANIFEST).read_text(encoding="utf-8"))
            if not isinstance(self.manifest, dict) or not isinstance(self.manifest.get("stages"), dict) \
                    or not isinstance(self.manifest.get("order"), list):
                raise ValueError("not a manifest object with 'stages' and 'order'")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RuntimeFailure(f"--resume: {self.path / MANIFEST} is corrupt ({exc}); the run cannot "
                                 "be resumed from it (restore it from a backup or start a new --run-dir)") from None
        if self.manifest.get("recipe") != recipe:
            raise UsageError(f"--resume: {self.path} is a '{self.manifest.get('recipe')}' run, "
                             f"not '{recipe}'")
        saved = self.manifest.get("config")
        if saved and saved != config:
            changed = changed_keys(config, saved, defaults)
            if any(not resumable_change(key) for key in changed):
                raise UsageError(f"--resume: the configuration differs from the run's "
                                 f"({', '.join(changed[:5])}); resume with the same options")
            self.manifest["config"] = config
        self.clean_partials()

    def clean_partials(self) -> None:
        """Remove temp files a killed run left (step outputs, checkpoint staging dirs)."""
        for path in self.path.rglob(".*"):
            if ".part" in path.name or ".sptool-tmp-" in path.name or ".sptool-old-" in path.name:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def save(self) -> None:
        """The manifest, then ``metrics.jsonl`` rebuilt from it (both atomic)."""
        write_json_atomic(self.path / MANIFEST, self.manifest)
        write_jsonl(self.path / "metrics.jsonl",
                    [self.manifest["stages"][key]["metrics_line"] for key in self.manifest["order"]])

    # -- finished steps ------------------------------------------------------------------------

    def finished(self, key: str) -> dict | None:
        return self.manifest["stages"].get(key)

    def finish(self, key: str, entry: dict) -> None:
        self.manifest["stages"][key] = entry
        self.manifest["order"].append(key)
        self.save()
        self._prune_checkpoints()

    def prune(self, role: str, keep: int, complete: Callable[[Path], bool] = Path.is_dir) -> None:
        """Remove ``role``'s older checkpoints down to the newest ``keep`` complete ones, except the
        one the manifest's latest train step names (a resume starts there): it goes at a later
        :meth:`finish`, once the manifest naming a newer checkpoint is on disk. So a kill between
        a new checkpoint and its manifest entry never loses the checkpoint the run resumes from."""
        if not keep:
            return
        with self._prune_lock:
            self._prune[role] = (keep, complete)
            self._prune_role(role, keep, complete)

    def _prune_checkpoints(self) -> None:
        with self._prune_lock:
            for role, (keep, complete) in self._prune.items():
                self._prune_role(role, keep, complete)

    def _prune_role(self, role: str, keep: int, complete: Callable[[Path], bool]) -> None:
        directories = sorted((p for p in (self.path / "ckpt" / role).glob("step-*") if complete(p)),
                             key=lambda p: int(p.name.split("-")[1]))
        named = self._named_checkpoints()
        for old in directories[:-keep]:
            if old.resolve() not in named:
                shutil.rmtree(old, ignore_errors=True)

    def _named_checkpoints(self) -> set[Path]:
        """The checkpoint each role's latest recorded train step names, per the manifest."""
        named: dict[str, Path] = {}
        for key in reversed(self.manifest.get("order", [])):
            entry = self.manifest["stages"].get(key, {})
            if entry.get("kind") != "train":
                continue
            try:
                records = read_jsonl(self.path / entry["output"])
            except (OSError, RuntimeFailure):
                continue
            for record in records:
                role, checkpoint = record.get("role"), record.get("checkpoint")
                if role and checkpoint and role not in named:
                    named[role] = (self.path / checkpoint).resolve()
        return set(named.values())

    def entries(self) -> Iterable[dict]:
        """Finished steps' entries in the order they finished."""
        return (self.manifest["stages"][key] for key in self.manifest["order"])

    def reader(self, key: str) -> Callable[[], list[dict]]:
        """Read a finished step's output back (once, lazily), checking its sha256."""
        entry = self.manifest["stages"][key]
        path = self.path / entry["output"]
        cache: list = []

        def read() -> list[dict]:
            if not cache:
                if not path.is_file() or file_sha256(path) != entry["sha256"]:
                    raise RuntimeFailure(f"--resume: {path} is missing or changed since it was written "
                                         f"(sha256 differs from {MANIFEST})")
                cache.append(read_jsonl(path))
            return cache[0]

        return read

    def latest_document(self, name: str) -> Path | None:
        """The last saved document ``name`` (e.g. ``tree``) of the finished steps."""
        found = None
        for entry in self.entries():
            if entry.get(name):
                found = entry[name]
        return self.path / found if found else None

    def write_step(self, key: str, kind: str, records: list[dict], *, seed: int, rejects: list[dict],
                   documents: dict[str, Any], before_rename: Callable[[], None],
                   lines: list[str] | None = None) -> dict:
        """Write a step's output (and rejects, documents); returns its manifest entry (no sha yet
        for metrics: the caller adds ``metrics_line``). ``lines`` gets the output's lines as written."""
        key = StepKey.parse(key)
        stem = key.stem
        directory = self.path / key.folder
        directory.mkdir(exist_ok=True)
        path = directory / f"{stem}.jsonl"
        entry: dict[str, Any] = {"kind": kind, "output": str(path.relative_to(self.path)),
                                 "records": len(records), "seed": seed}
        for name, document in documents.items():
            document_path = directory / f"{stem}.{name}.json"
            write_json_atomic(document_path, document)
            write_json_atomic(self.path / f"{name}.json", document)
            entry[name] = str(document_path.relative_to(self.path))
        if rejects:
            write_jsonl(directory / f"{stem}.rejects.jsonl", rejects)
        write_jsonl(path, records, before_rename=before_rename, lines=lines)
        entry["sha256"] = file_sha256(path)
        return entry
