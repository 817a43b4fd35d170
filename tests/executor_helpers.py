"""An in-process stand-in for the part of Ray that ``clmerge.sweep.RayExecutor`` uses (the fast tier's check of
the Ray backend; the real cluster is in slow tests)."""

from __future__ import annotations

import pickle
import types

__all__ = ["FakeRay"]


class FakeRay(types.ModuleType):
    """The part of Ray's API that ``RayExecutor`` uses, in process, with Ray's argument semantics: a task's
    top-level object refs are resolved before it runs, refs nested in lists are not (the job must ``get``
    them), and every argument and result crosses a pickle, as between Ray workers. ``wait`` returns the
    newest finished task, so results arrive in another order than the local executor's."""

    class ObjectRef:
        def __init__(self, value=None, error=None):
            self.value, self.error = value, error

    def __init__(self):
        super().__init__("ray")
        self.initialized, self.calls = False, 0

    def is_initialized(self):
        return self.initialized

    def init(self, **_):
        self.initialized = True

    def shutdown(self):
        self.initialized = False

    def put(self, value):
        return self.ObjectRef(pickle.loads(pickle.dumps(value)))

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs, num_returns=1):
        return refs[-num_returns:], refs[:-num_returns]

    def remote(self, **_):
        def wrap(fn):
            def call(*args):
                self.calls += 1
                args = pickle.loads(pickle.dumps([self.get(a) if isinstance(a, self.ObjectRef) else a for a in args]))
                try:
                    return self.ObjectRef(pickle.loads(pickle.dumps(fn(*args))))
                except Exception as exc:  # delivered at get(), as Ray does
                    return self.ObjectRef(error=exc)
            return types.SimpleNamespace(remote=call)
        return wrap
