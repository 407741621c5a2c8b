"""Packages a Packfeed process does without, although a library it uses would import them: refused as if they were
not installed, where that library carries on without them.

- pandas: pyarrow imports it (about 45 MiB resident) the first time it builds an array (in the server process,
  when its planner warms up by writing a plan), only to check whether the values are pandas objects. Refused
  for good in the server process (`packfeed serve`) and its workers.
- scipy: numba imports it (15-44 MiB, and 0.2 CPU s) to offer linear algebra inside compiled functions, which
  no Packfeed kernel uses. Every process refuses it while numba loads for Packfeed's kernels
  (`packfeed.media.jit`): routed plans import `scipy.optimize` themselves, later. The workers refuse both for
  good (`worker_preload`).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Refused(importlib.abc.MetaPathFinder):
    def __init__(self, *packages: str):
        self.packages = packages

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.packages:
            raise ModuleNotFoundError(f"{name} is not imported in Packfeed's server processes", name=name)
        return None


def refuse(*packages: str) -> Refused:
    """Refuse `packages` in this process from now on."""
    finder = Refused(*packages)
    sys.meta_path.insert(0, finder)
    return finder


@contextmanager
def refused(*packages: str) -> Iterator[None]:
    finder = refuse(*packages)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)

