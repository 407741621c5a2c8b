"""The project files a live sample crosses from `Producer.put` to the trainer's pack, measured on a real run
(issue [2/6] of the sixth wave counts them; run: python tests/live_sample_files.py).

A `packfeed serve` with a live spool and one worker, a trainer rank streaming a live job of one sample a step,
and a producer putting one sample: a text rollout, then one with an image sent as a file. Every Python process of
the run (the server, its worker processes, this one) watches each call into a project function while a marker
file says a sample is on its way (from just before `put` until the trainer holds the step), and counts the
function's file when the call is handed the sample or gives it back: its id, as text or in bytes (a request, a
spool record, a message, the encoded image, which carries it in a PNG text chunk), or a record holding it (a
sample, a step's rows, a pack in a step: through containers and at most two objects' attributes). A function
handed only the job (which holds its queue of samples), a queue or a step's number is not on the sample's path
and is not counted.

Every process starts this file's recorder through a `sitecustomize` on PYTHONPATH; a process started by fork
(the worker pool's) restarts the recorder's watcher thread, which threads do not survive."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("cli", "client", "loader_server", "media", "protos", "trainer")
NEEDLE = "live-path-sample-"  # in each measured sample's id, and in nothing else of the run

RECORDER = '''
import os, sys, threading, time, json
_dir, _marker = os.environ["PACKFEED_FILES_DIR"], os.environ["PACKFEED_FILES_MARKER"]
_needle = os.environ["PACKFEED_FILES_NEEDLE"]
_bytes = _needle.encode()
_roots = tuple(os.path.join(os.environ["PACKFEED_FILES_REPO"], part) + os.sep for part in
               os.environ["PACKFEED_FILES_PRODUCT"].split(","))
_on, _files = [False], set()
_WIDE = 64  # elements of a container looked into


def _holds(value, objects, depth=6):
    """Whether value is, or holds, the sample's id (its text, or bytes carrying it), through containers and at
    most `objects` objects' attributes: a record holding the sample (a pack in a step) is seen, the job holding
    its queue of samples is not."""
    if isinstance(value, str):
        return _needle in value
    if isinstance(value, (bytes, bytearray)):
        return _bytes in value
    if depth == 0 or isinstance(value, (int, float, bool, type(None), type, memoryview)) or callable(value):
        return False
    if hasattr(value, "DESCRIPTOR") and hasattr(value, "SerializePartialToString"):  # a protobuf message
        try:
            return _bytes in value.SerializePartialToString()
        except Exception:
            return False
    if isinstance(value, dict):
        return any(_holds(item, objects, depth - 1) for item in
                   list(value.keys())[:_WIDE] + list(value.values())[:_WIDE])
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds(item, objects, depth - 1) for item in list(value)[:_WIDE])
    if objects == 0 or isinstance(value, type(os)):
        return False
    if hasattr(value, "__dict__"):
        items = list(vars(value).values())[:_WIDE]
    elif hasattr(value, "__slots__"):
        items = [getattr(value, name, None) for name in value.__slots__][:_WIDE]
    else:
        return False
    return any(_holds(item, objects - 1, depth - 1) for item in items)


def _profile(frame, event, arg):
    if event not in ("call", "return") or not _on[0]:
        return
    code = frame.f_code
    if code.co_name == "<module>" or not code.co_filename.startswith(_roots) or code.co_filename in _files:
        return
    try:  # at a call, its arguments; at its return, what it gives back
        if any(_holds(value, 2) for value in list(frame.f_locals.values())) if event == "call" else _holds(arg, 2):
            _files.add(code.co_filename)
    except Exception:
        pass


def _turn(on):
    if on and not _on[0]:  # the window opened: say this process watches
        open(os.path.join(_dir, "on", f"{os.getpid()}-{time.monotonic_ns()}"), "w").close()
    if _on[0] and not on:  # the window closed: say what this process crossed
        with open(os.path.join(_dir, f"{os.getpid()}-{time.monotonic_ns()}.json"), "w") as out:
            json.dump({"argv": sys.argv[:3], "files": sorted(_files)}, out)
        _files.clear()
    _on[0] = on


def _watch():
    while True:
        _turn(os.path.exists(_marker))
        time.sleep(0.01)


def _start():
    _on[0] = False
    _turn(os.path.exists(_marker))
    threading.Thread(target=_watch, daemon=True).start()


sys.setprofile(_profile)
threading.setprofile(_profile)
os.register_at_fork(after_in_child=_start)
_start()
'''


def product_file(name: str) -> str | None:
    """A project file's path from the repo's root (the generated protobuf modules included); None otherwise."""
    try:
        relative = Path(name).resolve().relative_to(REPO)
    except ValueError:
        return None
    return str(relative) if relative.parts[0] in PRODUCT else None


def samples(conventions, rng) -> dict[str, dict]:
    import io

    import numpy as np
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from packfeed.media.image_policy import policy_from_dict

    text = rng.integers(100, 200, 64).astype(np.int32)
    policy = policy_from_dict(json.loads(conventions.image_policy.parameters_json))
    placeholders = policy.cost(112, 112, 1).llm_tokens
    image = np.concatenate([text[:7], np.full(placeholders, conventions.image_context_id, np.int32), text[7:30]])
    buffer, chunk = io.BytesIO(), PngInfo()
    chunk.add_text("comment", NEEDLE + "pixels")  # the encoded image carries the needle too: its readers count
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(buffer, format="PNG", pnginfo=chunk)
    return {"text": {"id": NEEDLE + "text", "tokens": text, "loss_mask": (np.arange(len(text)) >= 5).astype(np.uint8),
                     "group": "text"},
            "image file": {"id": NEEDLE + "image", "tokens": image, "images": [buffer.getvalue()], "group": "image",
                           "loss_mask": (np.arange(len(image)) >= 7 + placeholders).astype(np.uint8)}}


def crossed(records: Path, since: int) -> set[str]:
    files = set()
    for path in records.glob("*.json"):
        if int(path.stem.split("-")[1]) >= since:
            files |= {f for f in map(product_file, json.loads(path.read_text())["files"]) if f}
    return files


def records_since(records: Path, since: int) -> set[int]:
    """The processes that wrote a record (a file named pid-monotonic_ns) in `records` since `since`."""
    return {int(path.stem.split("-")[0]) for path in records.glob("*") if path.is_file()
            and int(path.stem.split("-")[1]) >= since}


def wait_for(records: Path, since: int, expected: set[int], wait_s: float) -> None:
    """Until each of `expected` that is still alive has written a record in `records` since `since`."""
    import psutil

    deadline = time.monotonic() + wait_s
    while not {pid for pid in expected if psutil.pid_exists(pid)} <= records_since(records, since):
        if time.monotonic() > deadline:
            missing = sorted(expected - records_since(records, since))
            raise TimeoutError(f"processes {missing} wrote no record in {wait_s:g} s")
        time.sleep(0.05)


def wait_until_every_process_watches(records: Path, since: int, server: int, wait_s: float = 250.0) -> None:
    """Until this process, the server and each of its descendants says it watches (a record in records/on)."""
    import psutil

    expected = {os.getpid(), server} | {child.pid for child in psutil.Process(server).children(recursive=True)}
    wait_for(records / "on", since, expected, wait_s)


def wait_for_what_the_watchers_crossed(records: Path, since: int, wait_s: float = 250.0) -> None:
    """Until each process that watched since `since` has said what it crossed. Only those: a process started
    after the window closed (a worker replaced, a helper started late) never watched and writes nothing."""
    wait_for(records, since, records_since(records / "on", since), wait_s)


def measure(index: Path, work: Path) -> dict[str, list[str]]:
    import numpy as np

    records, marker = work / "records", work / "on"
    (records / "on").mkdir(parents=True)
    (work / "sitecustomize.py").write_text(RECORDER)
    env = {"PACKFEED_FILES_DIR": str(records), "PACKFEED_FILES_MARKER": str(marker), "PACKFEED_FILES_NEEDLE": NEEDLE,
           "PACKFEED_FILES_REPO": str(REPO), "PACKFEED_FILES_PRODUCT": ",".join(PRODUCT),
           "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])}
    os.environ.update(env)  # this process's recorder: started below, as the others' start with them
    exec(compile(RECORDER, "live_sample_files recorder", "exec"), {})  # this process's (a sitecustomize ran)

    from packfeed.client import LocalServer, PackStream, PlanConfig, Producer

    found = {}
    with LocalServer(index, workers=1, env=env, extra_args=["--live-spool", str(work / "spool")]) as server:
        stream = PackStream(server.target, job="path", rank=0, plan=PlanConfig(dp=1, live=True, step_samples=1))
        steps, rng = iter(stream), np.random.default_rng(0)
        with Producer(server.target, job="path", open_wait_s=60) as producer:
            for kind, sample in samples(stream.conventions, rng).items():
                since = time.monotonic_ns()
                marker.touch()
                wait_until_every_process_watches(records, since, server.process.pid)  # all watch before the put
                producer.put(sample)
                step = next(steps)
                marker.unlink()
                assert [key for pack in step.packs for key in pack.sample_keys] == [sample["id"]], kind
                wait_for_what_the_watchers_crossed(records, since)
                found[kind] = sorted(crossed(records, since))
            producer.end()
        stream.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, help="an index to serve (default: the tests' small demo index)")
    parser.add_argument("--json", action="store_true", help="print the files as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        index = args.index
        if index is None:
            sys.path.insert(0, str(REPO / "tests"))
            from conftest import SMALL_TILE_POLICY
            from demo_data import indexed_demo

            index = indexed_demo(work / "demo", 40, 2, 3, SMALL_TILE_POLICY)[1]
        found = measure(index, work)
    if args.json:
        print(json.dumps(found))
        return
    for kind, files in found.items():
        print(f"files a live sample ({kind}) crosses from Producer.put to the trainer's pack: {len(files)}")
        print("".join(f"  {name}\n" for name in files), end="")


if __name__ == "__main__":
    main()
