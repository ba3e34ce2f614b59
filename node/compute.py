"""The compute thread every training role shares: one worker thread for whole-model work.

Inner steps, outer steps, fp32 copies, snapshot clones, evaluation, checkpoint writes and finite
checks of downloaded state run here, one at a time, so the event loop stays free to serve peers
and the model is never touched by two threads at once::

    compute = Compute(role.name)
    loss = await compute.run(train_steps, 50)     # on the worker thread, under compute.lock
    compute.stop()                                 # long loops poll compute.stopping
    if await compute.drain(5.0): ...               # nothing in flight any more

``lock`` is held while a job runs; code outside the thread that must read the model takes it
(``with compute.lock:``), never a second lock of its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ComputeClosed(RuntimeError):
    """Work was submitted after :meth:`Compute.close` (the role is draining). The supervisor ends a
    task that meets it quietly: a role's main loop that is still setting up when a drain closes its
    thread has nothing left to do, and that is not a failure."""


class Compute:
    def __init__(self, name: str = "compute"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-compute")
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._inflight: set[Future] = set()
        self._guard = threading.Lock()
        self._closed = False

    # ---------------- work ----------------
    def _call(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        with self.lock:
            return fn(*args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn`` on the worker thread; a concurrent.futures.Future. :class:`ComputeClosed`
        once :meth:`close` ran."""
        try:
            fut = self._pool.submit(self._call, fn, args, kwargs)
        except RuntimeError as exc:  # the pool's "cannot schedule new futures after shutdown"
            if not self._closed:
                raise
            raise ComputeClosed(f"{getattr(fn, '__name__', fn)!s} not run: the compute thread was closed "
                                "by the role's drain") from exc
        with self._guard:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._guard:
            self._inflight.discard(fut)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the worker thread. Cancelling the awaiting task does not
        interrupt a job that has started (poll :attr:`stopping` in long loops)."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    # ---------------- stop / drain ----------------
    def stop(self) -> None:
        """Ask long jobs to return early; new jobs are still accepted (e.g. a final checkpoint)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def busy(self) -> bool:
        with self._guard:
            return bool(self._inflight)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is queued or running (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._guard:
                pending = list(self._inflight)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                pending[0].exception(timeout=left)
            except Exception:  # noqa: BLE001 - TimeoutError, or the job's own failure: loop decides
                pass

    async def drain(self, timeout: float) -> bool:
        """Wait (off the event loop) for in-flight work; True if the thread is idle in time."""
        if not self.busy:
            return True
        return await asyncio.to_thread(self.wait_idle, timeout)

    def close(self) -> None:
        """Stop and release the thread once its current job ends (does not wait)."""
        self.stop()
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
