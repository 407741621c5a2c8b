"""Imported once per server by the pre-processing workers' fork server (multiprocessing's `forkserver`, which
`packfeed serve` starts with its worker pool): everything a worker needs is loaded here, and every worker is a
fork of this ready process.

A worker started from a fresh interpreter paid about 2 CPU seconds before its first sample (imports 0.6 s,
numba's start and loading its kernels 0.7 s, the rest the interpreter and the libraries' own set-up), in every
worker, at every job's first step on a fresh server and again at every restart of the pool. Forked from here it
pays a few milliseconds, and the pages loaded here stay shared between the workers until one writes them.

Nothing here starts a thread: a fork copies only the thread that forks. An import error leaves the worker to
load the module itself (multiprocessing ignores ImportError in a preload); any other failure is logged and
likewise left to the workers, which then fail with the error where a step needs the module.
"""

from __future__ import annotations

from packfeed.media.refused_imports import refuse


def _optional_libraries() -> None:
    """The fast path's decoders, where installed (a server without them serves no `pixels: fast` dataset)."""
    for name in ("cv2", "pyspng", "simplejpeg"):
        try:
            __import__(name)
        except ImportError:
            pass


def preload() -> None:
    """Import what a worker runs and load (compiling if the cache lacks them) the media kernels."""
    refuse("pandas", "scipy")
    _optional_libraries()
    from packfeed.media.resample import compile_kernels
    from packfeed.server.serve import live_reads, worker_process  # noqa: F401  (the step function and all it
    # imports; a live step's reads, which a worker meets first when it unpickles one)
    from packfeed.server.serve.observe import log

    try:
        compile_kernels()
    except Exception as error:  # noqa: BLE001  the workers compile what they need on first use
        log.warning("the workers' fork server could not load the media kernels: each worker loads them itself",
                    extra={"error": repr(error)})


preload()  # importing this module is what the fork server is asked to do
