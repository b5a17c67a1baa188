"""Output-path safety: never destroy an input, never replace a device, a FIFO or a symlink.

Every file sptool writes goes through :func:`output_target` (the JSONL writer and the JSON
writer call it): the target must be a regular file or not exist yet; a symlink is followed (the
file it points to is replaced, the link stays a link); a directory, a character or block device,
a FIFO or a socket is refused with one line, except the process's own standard output and
``/dev/null``, which are written through. Commands also call :func:`check_outputs` before any
work, which refuses an output that is the same file (after resolving links, hard links too) as
any file the command reads: its input, ``--tree``, ``--replay``, ``--prompt`` …

Temporary files are named ``.sptool-<host>-<pid>-<random>.part``; :func:`remove_stale_temps`
deletes the ones whose process is gone (killed with SIGKILL, power loss) the next time sptool
writes into that directory.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from sptool.core.records import UsageError

TEMP_PREFIX = ".sptool-"
TEMP_SUFFIX = ".part"
_LEGACY_MAX_AGE_S = 24 * 3600
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TEMP_NAME = re.compile(r"^\.sptool-(?:([0-9a-f]{6})-(\d+)-)?[A-Za-z0-9_]+\.part$")

#: Option names whose values are written, never read (excluded from a command's inputs).
OUTPUT_PARAMS = frozenset({"output", "rejects", "samples_out", "metrics_path", "pool", "run_dir",
                           "out", "output_dir"})


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _same_as_fd(st: os.stat_result, fd: int) -> bool:
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


@dataclass(frozen=True)
class Target:
    """Where to write: ``kind`` is ``stdout``, ``devnull`` or ``file`` (``path`` resolved)."""

    kind: str
    path: str | None = None


def output_target(path: str | os.PathLike | None, *, option: str = "--output") -> Target:
    """Check an output path and say how to write it (see the module docstring)."""
    if path in (None, "-"):
        return Target("stdout")
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None  # a new file, or a dangling symlink (its target will be created)
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror.lower()}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if not stat.S_ISDIR(st.st_mode) and _same_as_fd(st, 1):
            return Target("stdout")
        if stat.S_ISCHR(st.st_mode) and os.path.realpath(path) == os.devnull:
            return Target("devnull")
        hint = " (use '-' or leave it out for standard output)" if not stat.S_ISDIR(st.st_mode) else \
            ", expected a file path"
        raise UsageError(f"{option} {path} is {_kind(st.st_mode)}; refusing to replace it{hint}")
    resolved = os.path.realpath(path)
    directory = os.path.dirname(resolved) or "."
    if not os.path.isdir(directory):
        raise UsageError(f"{option} {path}: output directory {os.path.dirname(path) or '.'} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: output directory {os.path.dirname(path) or '.'} is not writable")
    if st is not None and not os.access(resolved, os.W_OK):
        raise UsageError(f"{option} {path}: the existing file is read-only")
    return Target("file", resolved)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _values(value) -> Iterable[str]:
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        yield text
        if text.startswith("local:"):  # --search local:PATH
            yield text[len("local:"):]
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _values(item)


def _current_context():
    """The running click context: typer >= 0.17 vendors click (typer._click), older ones use it."""
    for module in ("typer._click.globals", "click"):
        try:
            getter = importlib.import_module(module).get_current_context
        except (ImportError, AttributeError):
            continue
        context = getter(silent=True)
        if context is not None:
            return context
    return None


def command_inputs() -> list[str]:
    """Every existing regular file named by the running command's arguments and options, except
    the output options (:data:`OUTPUT_PARAMS`); standard input too when it is a regular file."""
    inputs: list[str] = []
    context = _current_context()
    while context is not None:
        for name, value in (context.params or {}).items():
            if name in OUTPUT_PARAMS:
                continue
            for text in _values(value):
                if text not in ("", "-") and _file_id(text) is not None:
                    inputs.append(text)
        context = context.parent
    return inputs


def check_outputs(outputs: Mapping[str, str | os.PathLike | None], *,
                  inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse (one line, exit 2) before any work when an output is a non-regular file, is the
    same file as an input (``inputs`` plus :func:`command_inputs`; None or ``-`` in ``inputs``
    means standard input), or two outputs are one file."""
    inputs = list(inputs)
    given = [os.fspath(p) for p in inputs if p not in (None, "-")]
    candidates = [(path, _file_id(path)) for path in given + command_inputs()]
    stdin_id = None
    if len(given) < len(inputs):  # the command reads standard input
        try:
            st = os.fstat(0)
            if stat.S_ISREG(st.st_mode):
                stdin_id = (st.st_dev, st.st_ino)
        except OSError:
            pass
    seen: dict[tuple[int, int] | str, str] = {}
    for option, path in outputs.items():
        if path in (None, "-"):
            continue
        target = output_target(path, option=option)
        if target.kind != "file":
            continue
        file_id = _file_id(target.path)
        if file_id is not None:
            for source, source_id in candidates:
                if source_id == file_id:
                    raise UsageError(f"{option} {path} is the same file as the input {source}; "
                                     "refusing to overwrite an input (choose another output file)")
            if file_id == stdin_id:
                raise UsageError(f"{option} {path} is the same file as standard input; refusing "
                                 "to overwrite an input (choose another output file)")
        key = file_id or target.path
        if key in seen:
            raise UsageError(f"{option} and {seen[key]} name the same file {path}; choose two files")
        seen[key] = option


def make_temp(directory: str, *, suffix: str = TEMP_SUFFIX) -> tuple[int, str]:
    """A new temporary file in ``directory`` named after this host and process; (fd, path).

    Stale temporary files of dead processes in the same directory are removed first.
    """
    remove_stale_temps(directory)
    fd, path = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{_HOST}-{os.getpid()}-", suffix=suffix,
                                dir=directory)
    return fd, path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: str) -> list[str]:
    """Delete ``.sptool-*.part`` files in ``directory`` left by processes of this host that are
    gone (and unnamed legacy ones older than a day); returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _TEMP_NAME.match(name)
        if not match:
            continue
        path = os.path.join(directory, name)
        host, pid = match.group(1), match.group(2)
        if host is not None:
            if host != _HOST or int(pid) == os.getpid() or _alive(int(pid)):
                continue
        else:
            try:
                if now - os.lstat(path).st_mtime < _LEGACY_MAX_AGE_S:
                    continue
            except OSError:
                continue
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def apply_default_mode(path: str, existing: str | None = None) -> None:
    """Give a finished temp file the mode a plain ``open(…, 'w')`` would have (0666 − umask),
    or the mode of the file it replaces."""
    try:
        if existing is not None and os.path.isfile(existing):
            mode = stat.S_IMODE(os.stat(existing).st_mode)
        else:
            mode = 0o666 & ~_umask()
        os.chmod(path, mode)
    except OSError:
        pass


def fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
