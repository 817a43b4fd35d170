"""Where jobs run: in this process, in a process pool, or on a Ray cluster.

An executor has three operations: ``submit(fn, *args) -> handle``, ``wait_any(handles) -> handle`` (the
next one to finish, so results stream back in completion order) and ``result(handle)``. A handle may be
passed as an argument of a later ``submit``: Ray then moves the object between workers itself (no trip
through the driver); the local executors pass the finished value.

The job functions must be importable top-level functions (process pools and Ray pickle them by name).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Executor", "LocalExecutor", "RayExecutor", "make_executor"]


class Executor(Protocol):
    name: str

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def put(self, value: Any) -> Any: ...

    def wait_any(self, handles: Sequence[Any]) -> Any: ...

    def result(self, handle: Any) -> Any: ...

    def close(self) -> None: ...


class _Deferred:
    """An in-process job, run when first waited on (so results stream in the driver's order)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args, self.done = fn, args, False
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        if not self.done:
            try:
                self.value = self.fn(*[_resolve_local(a) for a in self.args])
            except Exception as exc:  # delivered at result(), as a pool would
                self.error = exc
            self.done = True

    def result(self) -> Any:
        self.run()
        if self.error is not None:
            raise self.error
        return self.value


def _resolve_local(arg: Any) -> Any:
    if isinstance(arg, (cf.Future, _Deferred)):
        return arg.result()
    if isinstance(arg, list):
        return [_resolve_local(a) for a in arg]
    return arg


class LocalExecutor:
    """In process (``workers=0``: a job runs when the driver first waits on it) or a spawn process pool."""

    def __init__(self, workers: int = 0) -> None:
        self.name = "local"
        self.workers = workers
        self._pool = None
        if workers > 0:
            self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future | _Deferred:
        if self._pool is None:
            return _Deferred(fn, args)
        return self._pool.submit(fn, *tuple(_resolve_local(a) for a in args))

    def put(self, value: Any) -> Any:
        return value

    def wait_any(self, handles: Sequence[Any]) -> Any:
        """In process: runs and returns the first handle; pool: the first finished, in ``handles`` order."""
        if self._pool is None:
            handles[0].run()
            return handles[0]
        done, _ = cf.wait(handles, return_when=cf.FIRST_COMPLETED)
        return next(h for h in handles if h in done)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


class RayExecutor:
    """Ray tasks: ``address=None`` starts a local cluster (``num_cpus`` CPUs), ``"auto"`` or ``"ray://..."``
    or ``"HOST:PORT"`` joins an existing one. One remote task per job, one CPU each."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        import ray

        self.name = "ray"
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            # Workers import clmerge from their own installation; every job sets its torch thread count.
            if address is None:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
            self._started = True
        # One generic remote function: top-level ref arguments are resolved by Ray, lists of refs inside it.
        self._call = ray.remote(num_cpus=1)(_call_resolving)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._call.remote(fn, *args)

    def put(self, value: Any) -> Any:
        return self._ray.put(value)  # stored once, shared by every task that takes it

    def wait_any(self, handles: Sequence[Any]) -> Any:
        done, _ = self._ray.wait(list(handles), num_returns=1)
        return done[0]

    def result(self, handle: Any) -> Any:
        return self._ray.get(handle)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


def _call_resolving(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs in a Ray worker: ``fn(*args)`` with lists of object refs fetched first."""
    import ray

    def resolve(a: Any) -> Any:
        if isinstance(a, list):
            return [ray.get(x) if isinstance(x, ray.ObjectRef) else x for x in a]
        return a

    return fn(*[resolve(a) for a in args])


def make_executor(backend: str, *, workers: int = 0, address: str | None = None,
                  num_cpus: int | None = None) -> Executor:
    """``"local"`` (``workers`` > 0: a process pool) or ``"ray"``."""
    if backend == "local":
        return LocalExecutor(workers)
    if backend == "ray":
        return RayExecutor(address, num_cpus)
    raise ValueError(f"unknown backend {backend!r} (expected 'local' or 'ray')")
