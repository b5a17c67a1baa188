"""A process pool whose tasks have a hard deadline: a task that overruns is killed, not waited for.

``concurrent.futures`` cannot cancel a running task, and math-verify's own timeout relies on
``SIGALRM`` (main thread only) and still hangs on inputs that spin inside C code. Here every
worker is a process of its own on a pipe; a task past its deadline gets its worker terminated
and replaced, and the caller receives :class:`TaskTimeout` for that item while the others go on.
Results come back in input order, with a bounded number of items in flight.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator

from sptool.core.records import RuntimeFailure, UsageError


@dataclass
class TaskTimeout:
    seconds: float

    def __str__(self) -> str:
        return f"timed out after {self.seconds:g}s (worker killed)"


@dataclass
class TaskFailed:
    message: str

    def __str__(self) -> str:
        return self.message


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """End this worker when the parent dies, even by SIGKILL (which runs no cleanup there).

    On Linux the kernel sends SIGKILL to the worker when its parent goes (PR_SET_PDEATHSIG;
    only armed when the pool was started from the main thread, since the signal follows the
    thread that started the worker); everywhere a daemon thread also polls the parent's pid.
    """
    import os
    import threading

    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="sptool-parent-watch", daemon=True).start()


def _worker_loop(function: Callable[[Any], Any], warmup: Callable[[], Any] | None,
                 connection: Connection, parent_pid: int | None = None,
                 use_pdeathsig: bool = False) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if parent_pid is not None:
        _die_with_parent(parent_pid, use_pdeathsig)
    try:
        if warmup is not None:
            warmup()  # heavy imports happen before the first deadline starts ticking
        connection.send("__ready__")
    except (EOFError, OSError):
        return
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):  # the parent went away (e.g. killed by SIGPIPE)
            return
        if task == "__stop__":
            return
        if task is None:  # an item with nothing to do
            connection.send((True, None))
            continue
        try:
            try:
                reply = (True, function(task))
            except Exception as exc:  # report, never die on one bad item
                reply = (False, f"{type(exc).__name__}: {exc}")
            connection.send(reply)
        except (EOFError, OSError):
            return


class _Worker:
    def __init__(self, context, function, warmup):
        self.parent, child = context.Pipe()
        main_thread = threading.current_thread() is threading.main_thread()
        self.process = context.Process(target=_worker_loop,
                                       args=(function, warmup, child, os.getpid(), main_thread),
                                       daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.spawned = time.monotonic()
        self.task_index: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.parent.close()


class DeadlinePool:
    """Run ``function(item)`` in ``workers`` processes with a hard per-item ``deadline_s``.

    ``function`` must be importable (defined at module level). ``workers=0`` runs items inline in
    this process, without a deadline (for debugging).
    """

    STARTUP_TIMEOUT_S = 300.0

    def __init__(self, function: Callable[[Any], Any], *, workers: int = 2, deadline_s: float = 30.0,
                 warmup: Callable[[], Any] | None = None, start_method: str = "spawn",
                 max_in_flight: int | None = None):
        self.function = function
        self.warmup = warmup
        self.n_workers = max(0, int(workers))
        self.deadline_s = float(deadline_s)
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise UsageError(f"the deadline must be a finite number of seconds > 0, got {deadline_s}")
        self.max_in_flight = max_in_flight or max(4, 8 * self.n_workers)
        self._context = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self.timeouts = 0

    def _spawn(self) -> _Worker:
        return _Worker(self._context, self.function, self.warmup)

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """Yield each item's result (or :class:`TaskTimeout` / :class:`TaskFailed`) in order."""
        if self.n_workers == 0:
            for item in items:
                if item is None:
                    yield None
                    continue
                try:
                    yield self.function(item)
                except Exception as exc:
                    yield TaskFailed(f"{type(exc).__name__}: {exc}")
            return
        if not self._workers:
            self._workers = [self._spawn() for _ in range(self.n_workers)]
        source = iter(items)
        waiting: deque[tuple[int, Any]] = deque()
        results: dict[int, Any] = {}
        next_index = next_to_yield = 0
        exhausted = False
        while True:
            # keep the window full
            while not exhausted and next_index - next_to_yield < self.max_in_flight:
                try:
                    waiting.append((next_index, next(source)))
                    next_index += 1
                except StopIteration:
                    exhausted = True
            for worker in self._workers:
                if worker.ready and worker.task_index is None and waiting:
                    index, item = waiting.popleft()
                    worker.task_index, worker.started = index, time.monotonic()
                    worker.parent.send(item)
            while next_to_yield in results:
                yield results.pop(next_to_yield)
                next_to_yield += 1
            busy = [w for w in self._workers if w.task_index is not None]
            starting = [w for w in self._workers if not w.ready]
            if not busy and (not waiting or not starting):
                if exhausted and not waiting:
                    return
                continue
            now = time.monotonic()
            soonest = min([w.started + self.deadline_s for w in busy]
                          + [w.spawned + self.STARTUP_TIMEOUT_S for w in starting])
            ready = wait([w.parent for w in busy + starting], timeout=max(0.0, soonest - now))
            for worker in starting:
                if worker.parent in ready:
                    try:
                        worker.ready = worker.parent.recv() == "__ready__"
                    except (EOFError, OSError):
                        raise RuntimeFailure("a worker process died while starting") from None
                elif time.monotonic() - worker.spawned > self.STARTUP_TIMEOUT_S:
                    raise RuntimeFailure("a worker process did not start in time")
            for worker in busy:
                if worker.parent in ready:
                    try:
                        ok, value = worker.parent.recv()
                        results[worker.task_index] = value if ok else TaskFailed(value)
                        worker.task_index = None
                        continue
                    except (EOFError, OSError):  # the worker died (out of memory, segfault)
                        results[worker.task_index] = TaskFailed("worker process died")
                elif time.monotonic() - worker.started < self.deadline_s:
                    continue
                else:
                    results[worker.task_index] = TaskTimeout(self.deadline_s)
                    self.timeouts += 1
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.parent.send("__stop__")
            except (OSError, BrokenPipeError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
        self._workers = []

    def __enter__(self) -> "DeadlinePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
