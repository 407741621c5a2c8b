"""The loader side stays torch-free: no `packfeed.server` module (but the demo's client, `cli.consume`)
imports torch, and no process of a running server (main process and pre-processing workers) has it loaded.
Torch alone costs a process ~500 MB of resident memory (BENCHMARKS.md "Memory per server process")."""

from __future__ import annotations

import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import pytest

from packfeed.client import LocalServer
from processes import children, descendants, is_fork_server, wait_for_start, workers

CLIENT_SIDE = {"packfeed.cli.consume"}  # the demo's trainer-side clients


def test_no_server_module_imports_torch():
    import packfeed.server as server

    modules = [m.name for m in pkgutil.walk_packages(server.__path__, "packfeed.server.")
               if m.name not in CLIENT_SIDE and not m.name.endswith(".__main__")]  # __main__ runs the command
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "    if 'torch' in sys.modules or 'transformers' in sys.modules:\n"
             "        print(name); break\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(modules) > 40 and done.stdout.strip() == "", f"{done.stdout.strip()} imports torch"


def test_a_running_server_and_its_workers_never_load_torch_nor_the_workers_pandas_or_scipy(small_tile_index):
    """Torch would cost every server process 500 MiB; pandas, which pyarrow imports when it builds an array,
    45 MiB per worker, and scipy, which numba imports, 44 MiB (the server itself may use both). The workers
    are forks of a fork server that loaded what they need (`worker_preload`): it refuses them too."""
    from packfeed.client import PackStream

    def mapped() -> dict[int, str]:
        return {pid: Path(f"/proc/{pid}/maps").read_text() for pid in [server.process.pid, *descendants(server.process.pid)]
                if Path(f"/proc/{pid}/maps").exists()}

    def busy() -> list[int]:  # workers that have pre-processed samples (shards opened)
        return [pid for pid in workers(server.process.pid)
                if any(str(link.readlink()).endswith(".tar") for link in Path(f"/proc/{pid}/fd").iterdir())]

    with LocalServer(small_tile_index, workers=2) as server:
        with PackStream(server.target, job="footprint", rank=0, dp=1, microbatches=1) as stream:
            for _ in zip(range(40), stream):  # bounded: until both workers have prepared real samples
                maps, busy_workers = mapped(), busy()
                if len(busy_workers) == 2:
                    break
        fork_server = [pid for pid in children(server.process.pid) if is_fork_server(pid)]
    assert len(maps) >= 4 and len(fork_server) == 1  # the server, its fork server and two workers
    assert not [pid for pid, text in maps.items() if "libtorch" in text]
    assert len(busy_workers) == 2
    for pid in busy_workers + fork_server:
        assert "site-packages/pandas" not in maps[pid] and "site-packages/scipy" not in maps[pid], pid
        assert "libllvmlite" in maps[pid] and "cv2" in maps[pid]  # numba and OpenCV: loaded before the fork
    assert "site-packages/scipy" not in maps[server.process.pid]  # numba loaded without it: see refused_imports
    control = subprocess.run([sys.executable, "-c", "import sys, numba, numba.np.arraymath; print('scipy' in sys.modules)"],
                             capture_output=True, text=True, timeout=120)
    assert control.stdout.strip() == "True"  # where nothing refuses it, numba does load it



def test_a_server_loads_numba_at_its_first_plan_not_before(small_tile_index):
    """numba's LLVM is about 100 MiB resident (packfeed.media.jit): a started server that holds no job has not
    loaded it (its warm-up compiled the kernels in a child), its workers' fork server has, and the server's first
    job loads it (the control: the same reading sees it then)."""
    from packfeed.client import PackStream

    def llvm_mapped(pid: int) -> bool:
        return "libllvmlite" in Path(f"/proc/{pid}/maps").read_text()

    with LocalServer(small_tile_index, workers=1) as server:
        wait_for_start(server)
        before = llvm_mapped(server.process.pid)
        fork_server = [pid for pid in children(server.process.pid) if is_fork_server(pid)]
        with PackStream(server.target, job="first", rank=0, dp=1, microbatches=1) as stream:
            assert next(iter(stream)).sample_keys
        after = llvm_mapped(server.process.pid)
        assert len(fork_server) == 1 and llvm_mapped(fork_server[0])
    assert not before and after

def shared_files(pid: int) -> list[Path]:
    from packfeed.server.serve.step_files import SHARED_PREFIX, shared_directory

    return list(Path(shared_directory()).glob(f"{SHARED_PREFIX}{pid}-*"))


def test_prepared_steps_travel_in_shared_memory_files_used_again_and_removed_at_stop(small_tile_index):
    """Workers hand steps over in files in shared memory (no pickling of the pixels). A file comes back once its
    step was sent and carries a later step (new pages for every step cost the kernel 4x the copy), also after a
    stream cancelled mid-step; the server's stop removes them all."""
    import grpc

    from packfeed.client import PackStream
    from packfeed.v1 import packfeed_pb2 as pb

    with LocalServer(small_tile_index, workers=2) as server:
        pid, seen, steps = server.process.pid, set(), 0
        for epoch in range(5):
            with PackStream(server.target, job=f"whole-{epoch}", rank=0, dp=1, microbatches=2, prefetch=1) as stream:
                for step in stream:
                    steps += 1
                    seen.update(shared_files(pid))
        channel = grpc.insecure_channel(server.target)
        parts = channel.unary_stream("/packfeed.v1.Packfeed/StreamPackParts",
                                     request_serializer=pb.StreamPacksRequest.SerializeToString,
                                     response_deserializer=None)
        with PackStream(server.target, job="cancelled", rank=0, dp=1, microbatches=2) as stream:
            next(iter(stream))
        call = parts(pb.StreamPacksRequest(job="cancelled", rank=0))
        next(call)
        call.cancel()  # mid-step, with more steps in preparation
        channel.close()
        with PackStream(server.target, job="after", rank=0, dp=1, microbatches=2, prefetch=1) as stream:
            for step in stream:
                steps += 1
                seen.update(shared_files(pid))
        held = shared_files(pid)
    # at most a stream's steps in preparation (prefetch_steps 4), queued (4) and being sent (1); not one a step
    assert 0 < len(seen) <= 9 and steps >= 3 * len(seen)
    assert len(held) <= 9
    assert not shared_files(pid)


def test_a_step_falls_back_to_the_pipe_when_shared_memory_is_unusable(small_tile_index, tmp_path):
    from packfeed.server.serve import step_work, worker_process
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.v1.layout import Seat
    from packfeed.v1.options import PlanConfig

    source = step_work.DatasetSource(str(small_tile_index), str(Path(small_tile_index).parent / "tokenizer.json"))
    worker_process.init_worker({"d": source})
    registry = JobRegistry({"d": Dataset.open("d", source)})
    job = registry.open_job(JobSpec("fallback", "d", PlanConfig(dp=1, microbatches=2), 0))
    work = job.work(0, 0, Seat(0))
    inline = worker_process.build_rank_step(work)
    fallback = worker_process.build_rank_step(work, str(tmp_path / "missing" / "step"))
    assert fallback.shared is None and fallback.messages == inline.messages and inline.messages


def test_a_full_shared_memory_falls_back_to_the_pipe_and_frees_what_it_wrote(small_tile_index, tmp_path):
    """A write that runs out of room (here: a file size limit, as a full tmpfs would) sends the step through the
    pipe instead, and what was written of it is freed (the file, the pool's, is emptied)."""
    import subprocess
    import sys

    script = f"""
import resource, signal, sys
from pathlib import Path
from packfeed.server.serve import step_work, worker_process
from packfeed.server.serve.datasets import Dataset
from packfeed.server.serve.job_spec import JobSpec
from packfeed.server.serve.registry import JobRegistry
from packfeed.v1.layout import Seat
from packfeed.v1.options import PlanConfig
source = step_work.DatasetSource({str(small_tile_index)!r}, {str(Path(small_tile_index).parent / "tokenizer.json")!r})
worker_process.init_worker({{"d": source}})
job = JobRegistry({{"d": Dataset.open("d", source)}}).open_job(JobSpec("full", "d", PlanConfig(dp=1, microbatches=2), 0))
work = job.work(0, 0, Seat(0))
inline = worker_process.build_rank_step(work)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
full = worker_process.build_rank_step(work, {str(tmp_path / "step")!r})
assert inline.nbytes > 100_000, inline.nbytes
assert full.shared is None and full.messages == inline.messages
assert [(path.name, path.stat().st_size) for path in Path({str(tmp_path)!r}).iterdir()] == [("step", 0)]
print("fell back")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fell back" in done.stdout, done.stderr[-2000:]


def test_partial_writes_resume_where_they_stopped():
    from packfeed.server.serve.step_files import _advance

    pieces = [b"abc", memoryview(b"defg"), b"h"]
    assert [bytes(p) for p in _advance(pieces, 0)] == [b"abc", b"defg", b"h"]
    assert [bytes(p) for p in _advance(pieces, 2)] == [b"c", b"defg", b"h"]
    assert [bytes(p) for p in _advance(pieces, 3)] == [b"defg", b"h"]
    assert [bytes(p) for p in _advance(pieces, 5)] == [b"fg", b"h"]
    assert _advance(pieces, 8) == []


def test_shared_files_kept_for_reuse_are_bounded(tmp_path):
    """Free files come back up to `keep_bytes`, the ones past it are removed; a file an earlier, larger step
    grew is cut to twice the step it carries and 1 MiB when it holds more."""
    from packfeed.server.serve.step_files import SharedFiles, write_shared

    files = SharedFiles(str(tmp_path), keep_bytes=3 << 20)
    first, second = files.take(), files.take()
    assert first != second and files.created == 2
    write_shared(first, [[b"x" * (2 << 20)]])
    write_shared(second, [[b"y" * (2 << 20)]])
    files.give_back(first)  # 2.5 MiB free (the step, and a quarter spare): kept
    files.give_back(second)  # 5 MiB free would be over 3 MiB: removed
    assert Path(first).exists() and not Path(second).exists()
    assert files.take() == first and files.created == 2  # used again, not made anew
    half = 1 << 20
    assert write_shared(first, [[b"z" * half]]) == [[(0, half)]] and Path(first).stat().st_size == 5 * half // 2
    assert write_shared(first, [[b"w" * 500]]) == [[(0, 500)]] and Path(first).stat().st_size == half + 1000  # cut
    files.give_back(str(tmp_path / "never-written"))  # a worker that fell back to the pipe: nothing to keep
    assert files.take() != str(tmp_path / "never-written")


def test_the_servers_mapping_of_a_file_is_kept_and_follows_what_the_worker_wrote(tmp_path):
    """A step's messages are views of a mapping the pool keeps per file: a later step in the same file reads its
    own bytes, also once the file grew past the mapping or was cut short; the file comes back to the pool when
    the last view goes."""
    import gc

    from packfeed.server.serve.step_files import SharedFiles, write_shared
    from packfeed.server.serve.step_work import RankStepResult

    files = SharedFiles(str(tmp_path), keep_bytes=8 << 20)
    path = files.take()
    for size, byte in ((3000, b"a"), (2000, b"b"), (3 << 20, b"c"), (100, b"d")):  # same, smaller, grown, cut
        segments = write_shared(path, [[byte * (size // 2)], [byte * (size - size // 2)]])
        result = RankStepResult([], 1, shared=path, segments=segments, files=files).attach()
        assert [bytes(m) for m in result.messages] == [byte * (size // 2), byte * (size - size // 2)]
        assert files.take() != path  # in use while viewed (the other file, never written, is not kept)
        del result
        gc.collect()
        assert files.take() == path  # back once nothing views it, and handed out again
    assert Path(path).stat().st_size == (1 << 20) + 200


def test_a_worker_drops_its_mapping_of_a_file_the_server_removed(tmp_path):
    """A worker keeps a writable mapping of each file it wrote in place; once the server removes a file, the next
    write lets that mapping go (kept, it would hold the removed file's memory)."""
    from packfeed.server.serve import step_files

    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    for path in (first, second):
        step_files.write_shared(path, [[b"a" * 4096]])  # made (written with pwritev)
        step_files.write_shared(path, [[b"b" * 3000]])  # written in place, through the worker's mapping
        assert Path(path).read_bytes()[:3000] == b"b" * 3000 and path in step_files._MAPPED
    Path(first).unlink()
    step_files.write_shared(second, [[b"c" * 4096]])
    assert first not in step_files._MAPPED and second in step_files._MAPPED
    assert Path(second).read_bytes()[:4096] == b"c" * 4096
    step_files.forget_mapping(second)


def test_a_step_larger_than_its_file_is_written_in_place_up_to_the_end_and_appended_past_it(tmp_path):
    """What fits in a used file goes through the worker's mapping (kept), what goes past its end is appended;
    the file then holds the step's bytes exactly, also where a piece straddles the old end."""
    from packfeed.server.serve import step_files

    path = str(tmp_path / "step")
    step_files.write_shared(path, [[b"a" * 3000]])
    rng = random.Random(0)
    step = [[rng.randbytes(1000), memoryview(rng.randbytes(2500)), rng.randbytes(10)], [rng.randbytes(4000)]]
    assert step_files.write_shared(path, step) == [[(0, 3510)], [(3510, 4000)]]
    assert path in step_files._MAPPED and len(step_files._MAPPED[path]) == 3750  # the mapping: the file and its spare
    written = b"".join(bytes(piece) for pieces in step for piece in pieces)
    assert Path(path).read_bytes() == written + bytes(len(written) // 4)  # and a quarter spare, for later steps
    step_files.forget_mapping(path)


def test_a_worker_cuts_tiles_straight_into_the_steps_file(small_tile_index, tmp_path):
    """Tiles are written where the server reads them, in the step's shared file, not copied there: each message
    lies in several pieces of the file (its tiles among the first bytes), and reads back as the very bytes of
    the packs built in memory."""
    from packfeed.server.serve import step_files, step_work, worker_process
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.server.serve.wire import SplitMessage
    from packfeed.v1.layout import Seat
    from packfeed.v1.options import PlanConfig

    source = step_work.DatasetSource(str(small_tile_index), str(Path(small_tile_index).parent / "tokenizer.json"))
    worker_process.init_worker({"d": source})
    registry = JobRegistry({"d": Dataset.open("d", source)})
    job = registry.open_job(JobSpec("arena", "d", PlanConfig(dp=1, microbatches=2), 0))
    files, in_place = step_files.SharedFiles(str(tmp_path), keep_bytes=1 << 30), []
    for step in [0, 1, 2, 0, 1, 2]:  # the pool's file is made by the first step, then holds the others' tiles
        work = job.work(0, step, Seat(0))
        inline = worker_process.build_rank_step(work)
        path = files.take()
        shared = worker_process.build_rank_step(work, path)
        assert shared.shared == path and path not in step_files._MAPPED  # unmapped: the file's pages are the server's
        shared.files = files
        in_place.append(any(isinstance(message, SplitMessage) for message in shared.attach().messages))
        assert [bytes(message) for message in shared.messages] == inline.messages
        assert shared.nbytes == sum(len(message) for message in inline.messages)
        shared.messages = []
    assert not in_place[0] and sum(in_place) >= 3 and files.created == 1


def test_pieces_cut_in_the_arena_stay_where_they_are_and_the_rest_follows_them(tmp_path):
    """`_write_shared` leaves what was cut in the step's arena in place (also past a hole: a sample left out
    after its first tiles were cut) and writes the other pieces after the arena's tiles."""
    from packfeed.server.serve import step_files

    path = str(tmp_path / "step")
    assert step_files.TileArena.open(path, 150) is None  # a new file is written as before
    step_files.write_shared(path, [[bytes(150 + (1 << 20))]])
    arena = step_files.TileArena.open(path, 150)
    first, hole, second = arena.empty((3, 5, 4)), arena.empty((10,)), arena.empty((2, 7))
    first[:], hole[:], second[:] = 1, 9, 2
    message = [b"head", memoryview(first).cast("B"), memoryview(second).cast("B"), b"tail"]
    segments = step_files.write_shared(path, [message, [b"next"]], arena)
    assert segments == [[(84, 4), (0, 60), (70, 14), (88, 4)], [(92, 4)]]
    data = Path(path).read_bytes()
    assert b"".join(data[offset:offset + length] for offset, length in segments[0]) == \
        b"head" + b"\x01" * 60 + b"\x02" * 14 + b"tail"
    assert Path(path).stat().st_size == 2 * 96 + (1 << 20)  # cut: no more than twice the step, and 1 MiB
    del first, hole, second, message, arena
    step_files.forget_mapping(path)


GIVE_BACK_SCRIPT = """
import time
import numpy as np
from packfeed.server.serve import worker_process

def anon_mib():
    return int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('RssAnon:'))) // 1024

worker_process.keep_freed_memory(give_back_after={after})
base = anon_mib()
blocks = [np.ones(8 << 20, np.uint8) for _ in range(10)]  # 80 MiB in blocks under 64 MiB: from the heap
del blocks
kept = anon_mib()
worker_process._ACTIVITY.update(busy=False, since=time.monotonic(), given_back=False)  # as a step leaves it
{give_back}
for _ in range(100):  # bounded: 10 s at most
    if anon_mib() < base + 40:
        break
    time.sleep(0.1)
print(base, kept, anon_mib())
"""


@pytest.mark.parametrize("how", ["asked", "idle"])
def test_kept_memory_is_given_back(how):
    """A worker keeps what it frees for its next step (glibc's malloc), and gives it back to the kernel once it has
    prepared no step for a while (here 0.3 s), or when asked."""
    script = GIVE_BACK_SCRIPT.format(after=0.3 if how == "idle" else None,
                                     give_back="worker_process.give_back_freed_memory()" if how == "asked" else "")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    base, kept, after = (int(v) for v in done.stdout.split())
    assert kept >= base + 70 and after < base + 40, (base, kept, after)
