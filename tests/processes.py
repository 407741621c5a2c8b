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


START_MARKS = ('"planner ready"', "\"workers' fork server ready\"")  # what a server logs once it has started


def wait_for_start(server, timeout: float = 120.0) -> None:
    """Until a `LocalServer` has done what a server does once in its life: its planner's warm-up and its workers'
    fork server loaded (their log lines)."""
    import time

    deadline = time.monotonic() + timeout
    while not all(any(mark in line for line in server.log) for mark in START_MARKS) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(any(mark in line for line in server.log) for mark in START_MARKS), server.log[-5:]


PAGE = 4096
_PRESENT, _FRAME = 1 << 63, (1 << 55) - 1  # /proc/PID/pagemap: bit 63 "present", bits 0-54 the page frame


def resident_frames(pid: int):
    """The physical page frames a process has resident (numpy uint64; root reads real frame numbers)."""
    import numpy as np

    frames = []
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                if fields[-1] == "[vsyscall]":  # outside the process's own page tables
                    continue
                start, end = (int(address, 16) for address in fields[0].split("-"))
                pagemap.seek(start // PAGE * 8)
                entries = np.frombuffer(pagemap.read((end - start) // PAGE * 8), dtype=np.uint64)
                frames.append(entries[(entries & np.uint64(_PRESENT)) != 0] & np.uint64(_FRAME))
    except OSError:  # gone meanwhile
        pass
    return np.concatenate(frames) if frames else np.empty(0, np.uint64)


def tree_resident_mib(pid: int) -> float:
    """Memory a process tree holds, each physical page counted once however many of its processes map it (what
    the tree's own cgroup would count of it, libraries included), whatever other processes on the machine map."""
    import numpy as np

    frames = [resident_frames(each) for each in [pid, *descendants(pid)]]
    return len(np.unique(np.concatenate(frames))) * PAGE / (1 << 20)
