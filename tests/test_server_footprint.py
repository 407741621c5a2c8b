"""The loader side stays torch-free: no `packfeed.server` module (but the demo's client, `tools.consume`)
imports torch, and no process of a running server (main process and pre-processing workers) has it loaded.
Torch alone costs a process ~500 MB of resident memory (BENCHMARKS.md "Memory per server process")."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

from packfeed.client import LocalServer

CLIENT_SIDE = {"packfeed.server.tools.consume"}  # the demo's trainer-side clients


def test_no_server_module_imports_torch():
    import packfeed.server as server

    modules = [m.name for m in pkgutil.walk_packages(server.__path__, "packfeed.server.") if m.name not in CLIENT_SIDE]
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "    if 'torch' in sys.modules or 'transformers' in sys.modules:\n"
             "        print(name); break\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(modules) > 40 and done.stdout.strip() == "", f"{done.stdout.strip()} imports torch"


def process_tree(pid: int) -> list[int]:
    pids, found = [pid], []
    while pids:
        current = pids.pop()
        found.append(current)
        try:
            pids += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return found


def test_a_running_server_and_its_workers_never_load_torch(small_tile_index):
    from packfeed.client import PackStream

    with LocalServer(small_tile_index, workers=2) as server:
        with PackStream(server.target, job="footprint", rank=0, dp=1, microbatches=1) as stream:
            next(iter(stream))  # the workers have pre-processed real samples
        tree = process_tree(server.process.pid)
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in tree if Path(f"/proc/{pid}/maps").exists()}
    assert len(maps) >= 3  # the server and its two workers
    assert not [pid for pid, text in maps.items() if "libtorch" in text]
