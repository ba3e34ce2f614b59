"""Supervised background coroutines: never a bare ``asyncio.create_task``.

A failing task is logged, counted in ``swarmnode_task_failures_total{task}`` and restarted
with backoff up to ``max_restarts``; past that the node is unhealthy (``/healthz`` 500) and the
daemon exits 1 so the orchestrator restarts it. Tasks that return normally are done, and so are
tasks that meet :class:`~node.compute.ComputeClosed` (their role drained while they ran).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from node.compute import ComputeClosed
from node.logs import emit
from node.metrics import TASK_FAILURES

log = logging.getLogger("swarmnode.supervisor")


class Supervisor:
    def __init__(self, max_restarts: int = 5, on_fatal: Callable[[str, BaseException], None] | None = None):
        self.max_restarts = max_restarts
        self._on_fatal = on_fatal
        self._tasks: dict[str, asyncio.Task] = {}
        self.failed: str | None = None

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], restart: bool = True) -> asyncio.Task:
        if name in self._tasks and not self._tasks[name].done():
            raise RuntimeError(f"task {name} already running")
        task = asyncio.get_running_loop().create_task(self._run(name, factory, restart), name=name)
        self._tasks[name] = task
        return task

    async def _run(self, name: str, factory: Callable[[], Awaitable[None]], restart: bool) -> None:
        failures = 0
        while True:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except ComputeClosed as exc:  # the role drained under the task: it is done, not failed
                emit(log, "task_stopped", "task {task} stopped: {detail}", task=name, detail=str(exc))
                return
            except BaseException as exc:  # noqa: BLE001 - supervised: log, count, decide
                failures += 1
                TASK_FAILURES.labels(task=name).inc()
                emit(log, "task_failed", "task {task} failed ({failures}/{max_restarts}): {error}",
                     level=logging.ERROR, exc_info=exc, task=name, failures=failures,
                     max_restarts=self.max_restarts, error=repr(exc))
                if not restart or failures > self.max_restarts:
                    self.failed = name
                    if self._on_fatal:
                        self._on_fatal(name, exc)
                    return
                await asyncio.sleep(min(30.0, 0.5 * 2 ** failures))

    @property
    def healthy(self) -> bool:
        return self.failed is None

    async def cancel_all(self, timeout: float = 2.0) -> None:
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
