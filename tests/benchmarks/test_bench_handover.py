"""What moving a prepared step costs after its pixels exist, each way against the one it replaced, interleaved:

- handing a step to the server in shared memory: a new file per step (as before) against the pool's files
  used again (`SharedFiles`), written as a worker writes (`_write_shared`) and mapped as the server maps
  (`RankStepResult.attach`, then copied out as the server hands it to gRPC); CPU of this process, user +
  system;
- a worker writing a step into a file that holds one already: pwritev (as it wrote every step before) against
  its kept mapping of the file (`_write_shared`); the step as a pack's pieces, one per tile;
- cutting tiles channels first: numpy's copy of a transposed view against `packfeed.media.chw`;
- a worker cutting a step's tiles into its memory and copying them into the step's file, against cutting them
  straight into the file (`_TileArena`).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_handover.py -m benchmark
"""

from __future__ import annotations

import os
import resource
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.benchmark
STEP_BYTES = 8 << 20  # about two photographs' tiles (4.3 MB per sample)
ROUNDS, STEPS = 3, 40


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def best_seconds(ways: dict, repeat: int, check=lambda: None) -> dict[str, float]:
    """CPU seconds per call of each way, the best of ROUNDS interleaved rounds of `repeat` calls; `check()` after
    each way's calls."""
    best = {name: float("inf") for name in ways}
    for _ in range(ROUNDS):
        for name, way in ways.items():
            started = cpu_seconds()
            for _ in range(repeat):
                way()
            best[name] = min(best[name], (cpu_seconds() - started) / repeat)
            check()
    return best


def hand_over(pieces: list, files, directory: str) -> None:
    """One step written into a file as a worker does, mapped and copied out as the server does, then let go."""
    from packfeed.server.serve.step_files import SHARED_PREFIX, write_shared
    from packfeed.server.serve.step_work import RankStepResult

    path = files.take() if files else os.path.join(directory, f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    result = RankStepResult([], 1, shared=path, segments=write_shared(path, [pieces]),
                            files=files)
    result.attach()
    assert len(bytes(result.messages[0])) == STEP_BYTES  # copied out, as the server hands it to gRPC
    result.messages = []  # the mapping goes: a pool's file comes back, a lone one is removed


def test_shared_memory_files_new_or_used_again():
    from packfeed.server.serve.step_files import SharedFiles, remove_shared_files, shared_directory

    directory = shared_directory()
    pieces = [np.random.default_rng(0).integers(0, 256, STEP_BYTES, dtype=np.uint8)]
    files = SharedFiles(directory, 1 << 30)
    fresh, reused = "a new file per step", "the pool's files used again"
    try:
        best = best_seconds({fresh: lambda: hand_over(pieces, None, directory),
                             reused: lambda: hand_over(pieces, files, directory)}, STEPS)
    finally:
        files.clear()
        remove_shared_files(directory, os.getpid())
    for name, seconds in best.items():
        print(f"\n[handover] {STEP_BYTES >> 20} MB step, {name}: {seconds * 1e3:.2f} ms CPU (write, map, copy out)", end="")
    print(f"\n[handover] used again: {best[fresh] / best[reused]:.1f}x less CPU")
    assert files.created == 1  # every step after the first wrote into the same file


def test_writing_a_step_into_a_file_used_again():
    from packfeed.server.serve import step_files

    directory = step_files.shared_directory()
    path = os.path.join(directory, f"{step_files.SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    tile = 3 * 448 * 448
    pieces = [np.random.default_rng(k).integers(0, 256, tile, dtype=np.uint8) for k in range(STEP_BYTES // tile)]
    expected = b"".join(pieces)

    def pwritev() -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            step_files._pwrite_all(fd, [memoryview(piece) for piece in pieces])
        finally:
            os.close(fd)

    def check() -> None:
        with open(path, "rb") as written:
            assert written.read(len(expected)) == expected

    ways = {"pwritev": pwritev, "the worker's kept mapping": lambda: step_files.write_shared(path, [pieces])}
    try:
        step_files.write_shared(path, [pieces])  # the file exists, its pages allocated, as a pool's file is
        best = best_seconds(ways, STEPS, check)
    finally:
        step_files.forget_mapping(path)
        step_files.remove_shared_files(directory, os.getpid())
    for name, seconds in best.items():
        print(f"\n[write] {len(expected) / 1e6:.1f} MB step in {len(pieces)} pieces, {name}: {seconds * 1e3:.2f} ms CPU",
              end="")
    ratio = best["pwritev"] / best["the worker's kept mapping"]
    print(f"\n[write] kept mapping: {ratio:.1f}x less CPU")


def test_cutting_tiles_channels_first():
    from packfeed.media.chw import chw_tiles

    image = np.random.default_rng(0).integers(0, 256, (1344, 1792, 3), dtype=np.uint8)  # a 4 x 3 InternVL grid
    boxes = [(top, left, 448, 448) for top in range(0, 1344, 448) for left in range(0, 1792, 448)]
    ways = {"numpy (transposed view copied)": lambda: [np.ascontiguousarray(image[t:t + h, l:l + w].transpose(2, 0, 1))
                                                       for t, l, h, w in boxes],
            "packfeed.media.chw": lambda: chw_tiles(image, boxes)}
    assert all(np.array_equal(a, b) for a, b in zip(*(way() for way in ways.values())))
    for name, seconds in best_seconds(ways, 10).items():
        print(f"\n[chw] 12 tiles of 448 px (7.2 MB), {name}: {seconds * 1e3:.2f} ms", end="")
    print()


def test_cutting_tiles_into_the_steps_file():
    """A worker cutting a step's tiles (two 4 x 3 InternVL grids and their thumbnails, 15.7 MB) and writing the step
    into a file that holds one already: tiles cut into the worker's memory, then copied into the file through its
    kept mapping (as before), against tiles cut straight into the file (`_TileArena`), the rest of the step
    written after them."""
    from packfeed.media.chw import chw_tiles
    from packfeed.server.serve import step_files, worker_process

    worker_process.keep_freed_memory()  # as a worker: tiles cut into its memory reuse freed blocks, not fresh pages
    directory = step_files.shared_directory()
    path = os.path.join(directory, f"{step_files.SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    image = np.random.default_rng(0).integers(0, 256, (1344, 1792, 3), dtype=np.uint8)
    boxes = [(top, left, 448, 448) for top in range(0, 1344, 448) for left in range(0, 1792, 448)] + [(0, 0, 448, 448)]
    capacity = 2 * len(boxes) * 3 * 448 * 448
    head = b"\1" * 60_000  # tokens, labels, positions and the rest of the messages

    def cut(empty) -> list:
        return [head, *(memoryview(tile).cast("B") for _ in range(2) for tile in chw_tiles(image, boxes, empty))]

    def copied() -> None:
        step_files.write_shared(path, [cut(np.empty)])

    def in_place() -> list:
        arena = step_files.TileArena.open(path, capacity)
        assert arena is not None
        return step_files.write_shared(path, [cut(arena.empty)], arena)

    try:
        copied()  # the file exists with room for the step, its pages allocated, as a pool's file is
        segments = in_place()[0]
        with open(path, "rb") as written:
            data = written.read()
        assert len(segments) > 1 and b"".join(data[at:at + n] for at, n in segments) == b"".join(cut(np.empty))
        best = best_seconds({"cut into memory, then copied into the file": copied,
                             "cut straight into the file": in_place}, STEPS // 4)
    finally:
        step_files.forget_mapping(path)
        step_files.remove_shared_files(directory, os.getpid())
    for name, seconds in best.items():
        print(f"\n[arena] {capacity / 1e6:.1f} MB of tiles, {name}: {seconds * 1e3:.2f} ms CPU", end="")
    ratio = best["cut into memory, then copied into the file"] / best["cut straight into the file"]
    print(f"\n[arena] cut straight into the file: {ratio:.2f}x less CPU")
