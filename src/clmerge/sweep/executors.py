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
import os
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


class LocalExecutor:
    """In process (``workers=0``: a job runs at ``submit``) or a spawn-started process pool."""

    def __init__(self, workers: int = 0) -> None:
        self.name = "local"
        self.workers = workers
        self._pool = None
        if workers > 0:
            self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def _resolve(self, arg: Any) -> Any:
        if isinstance(arg, cf.Future):
            return arg.result()
        if isinstance(arg, list):
            return [self._resolve(a) for a in arg]
        return arg

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        args = tuple(self._resolve(a) for a in args)
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # delivered at result(), as a pool would
            fut.set_exception(exc)
        return fut

    def put(self, value: Any) -> Any:
        return value

    def wait_any(self, handles: Sequence[cf.Future]) -> cf.Future:
        done, _ = cf.wait(handles, return_when=cf.FIRST_COMPLETED)
        return min(done, key=lambda f: handles.index(f))  # deterministic among those already done

    def result(self, handle: cf.Future) -> Any:
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
            # Workers import clmerge from the same installation; keep their torch at one thread unless told.
            env = {"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}}
            if address is None:
                ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=False)
            else:
                ray.init(address=address, runtime_env=env, log_to_driver=False)
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
