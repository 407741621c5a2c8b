"""numba kernels declared without importing numba: a process loads numba the first time one of them runs.

Importing numba maps LLVM: about 100 MiB resident in every process that imports it (BENCHMARKS.md "Memory per
server process"). A loader server that holds no job yet (a standby beside its peer, a fleet before training
starts) plans nothing, so it should not hold them; nor should a trainer that never decodes on its side.

`@kernel(**options)` declares `numba.njit(**options)(function)` and returns a stand-in that forwards each call.
The first call of any declared kernel imports numba (without scipy, below) and builds every declared kernel's
dispatcher at once (each still compiles, or loads from numba's cache, per signature on its first call), then
puts the dispatchers and `numba.prange` in place of the stand-ins in the modules that declared kernels: a kernel
calling another from compiled code finds a real dispatcher among its globals, as numba requires. Code elsewhere
that imported a kernel by name keeps the stand-in, which costs an attribute read per call. The dispatchers are
numba's own, built from the same functions, so numba's on-disk cache (`packfeed warmup`) and its
compiled code are exactly what they were with `@numba.njit`.

scipy: numba imports it (15-44 MiB, and 0.2 CPU s) to offer linear algebra inside compiled functions, which no
Packfeed kernel uses; where nothing imported it yet, numba loads here with it refused.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from packfeed.media.refused_imports import refused


def prange(*args: int) -> range:
    """`numba.prange` in a kernel (in place once numba is loaded); `range` for anything else that calls it."""
    return range(*args)


class Kernel:
    """A declared kernel: forwards each call to its numba dispatcher, built on the first call of any kernel."""

    def __init__(self, function: Callable, options: dict[str, Any]):
        self.function, self.options, self.dispatcher = function, options, None
        self.__name__, self.__qualname__, self.__doc__ = function.__name__, function.__qualname__, function.__doc__
        self.__module__ = function.__module__

    def __call__(self, *args, **kwargs):
        if self.dispatcher is None:
            load_numba()
        return self.dispatcher(*args, **kwargs)


_declared: list[Kernel] = []
_lock = threading.Lock()


def kernel(**options: Any) -> Callable[[Callable], Kernel]:
    """`numba.njit(**options)`, deferred: see the module's docstring."""
    def declare(function: Callable) -> Kernel:
        declared = Kernel(function, options)
        with _lock:
            _declared.append(declared)
        return declared

    return declare


def _import_numba() -> None:
    if "scipy" in sys.modules or "numba" in sys.modules:
        import numba  # noqa: F401
        return
    with refused("scipy"):
        import numba.np.arraymath  # noqa: F401  (the module that decides whether linear algebra is there)


def load_numba() -> None:
    """Import numba and build every declared kernel not built yet (idempotent, thread-safe). A kernel declared
    after this (its module imported later) is built by its own first call."""
    with _lock:
        pending = [each for each in _declared if each.dispatcher is None]
        if not pending:
            return
        _import_numba()
        import numba

        built = {id(each): numba.njit(**each.options)(each.function) for each in pending}
        # the globals first, the stand-ins last: a call in another thread that finds its dispatcher set may
        # compile it, and its compiled callees must be dispatchers in its module's globals by then
        for module in {sys.modules[each.__module__] for each in pending}:
            names = vars(module)
            for name, value in list(names.items()):
                if isinstance(value, Kernel):
                    names[name] = built.get(id(value), value.dispatcher) or value
                elif value is prange:
                    names[name] = numba.prange
        for each in pending:
            each.dispatcher = built[id(each)]
