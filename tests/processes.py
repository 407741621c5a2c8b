"""A `packfeed serve` process tree as tests see it: the server; its children (multiprocessing's resource tracker
and the workers' fork server); the pre-processing workers, children of the fork server."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # gone meanwhile
        return []


def descendants(pid: int) -> list[int]:
    """Every live process under `pid`, children first."""
    found, pending = [], children(pid)
    while pending:
        found.append(pending.pop(0))
        pending += children(found[-1])
    return found


def is_fork_server(pid: int) -> bool:
    try:
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def workers(server_pid: int) -> list[int]:
    """The server's pre-processing workers (forks of its fork server)."""
    return [worker for child in children(server_pid) if is_fork_server(child) for worker in children(child)]
