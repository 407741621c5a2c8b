"""A live job's spool: every sample a producer put, durable before the put is answered and kept until every rank
has acknowledged the step that took it, and each step's membership, recorded before any of the step is sent. A
server killed outright re-opens the job from its spool with nothing lost and nothing repeated.

A job's folder (ROOT/<job id, made safe>-<its digest>), plain files any tool reads:
    job.json           the job's settings, checked when a server opens the job on this spool again
    batches/B.tar      one put's accepted samples, a plain tar: per sample S (its place in the put, 6 digits)
                       S.tokens.npy, S.loss_mask.npy, S.NAME.npy per tensor and S.K.img per image file
    batches/B.json     their rows: id, group, policy version, loads, each member's offset and size in the tar
    steps/S.json       step S's members (their ids, in the order planned from) and the samples it dropped as stale
    ended.json         the job ended: its last step
A batch is durable once its rows exist: each file is written whole under a temporary name, flushed to disk and
renamed, the tar before its rows, so a put that never answered leaves at most a tar without rows, removed on
open. Only local folders (a shared file system for a second server) for now; object stores are not spools yet.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import numpy as np

from packfeed.server.live.samples import LiveSample

BATCH_DIGITS = 12


def job_folder(root: str | Path, job: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]
    return Path(root) / f"{safe}-{hashlib.sha256(job.encode()).hexdigest()[:12]}"


class SpoolError(Exception):
    """The spool cannot hold or give back what the job needs (a full disk, a folder of another job)."""


class SpoolFull(SpoolError):
    """The spool holds its bound (`--live-spool-max-gb`): producers wait until trainers acknowledge steps."""


class Spool:
    def __init__(self, root: str | Path, job: str, described: str):
        self.dir = job_folder(root, job)
        try:
            (self.dir / "batches").mkdir(parents=True, exist_ok=True)
            (self.dir / "steps").mkdir(exist_ok=True)
        except OSError as error:
            raise SpoolError(f"cannot create the live spool {self.dir}: {error}") from None
        recorded = self.read_json("job.json")
        if recorded is None:
            self.write_json("job.json", {"job": job, "settings": json.loads(described)})
        elif recorded.get("settings") != json.loads(described):
            raise SpoolError(f"the spool {self.dir} holds job {job!r} with other settings "
                             f"({json.dumps(recorded.get('settings'), sort_keys=True)}): open it with those, or "
                             "use a new job id")
        for orphan in (self.dir / "batches").glob("*.tar"):  # a put that never answered
            if not orphan.with_suffix(".json").exists():
                orphan.unlink(missing_ok=True)
        self.bytes = sum(path.stat().st_size for path in (self.dir / "batches").iterdir())

    # -- batches ----------------------------------------------------------------------------------------

    def write_batch(self, number: int, samples: list[LiveSample]) -> list[dict]:
        """The samples as batch `number` (durable when this returns); their rows, as `read_batches` gives them."""
        tar_path = self._batch(number, ".tar")
        rows, buffer = [], io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for place, sample in enumerate(samples):
                members = {"tokens": _npy(sample.tokens), "loss_mask": _npy(sample.loss_mask)}
                members.update({name: _npy(values) for name, values in sample.tensors.items()})
                spans = {name: _add(tar, f"{place:06d}.{name}.npy", data) for name, data in members.items()}
                images = [_add(tar, f"{place:06d}.{k}.img", data) for k, data in enumerate(sample.images)]
                rows.append({**sample.record(), "batch": number, "place": place, "members": spans,
                             "images": images})
        data = buffer.getvalue()
        self._write(tar_path, data)
        self._write(self._batch(number, ".json"), json.dumps(rows).encode())
        self.bytes += len(data)
        return rows

    def read_batches(self) -> list[tuple[int, list[dict]]]:
        """(number, rows) of every durable batch, in order."""
        out = []
        for path in sorted((self.dir / "batches").glob("*.json")):
            out.append((int(path.stem), json.loads(path.read_bytes())))
        return out

    def remove_batch(self, number: int) -> None:
        """A batch every rank has consumed: its files go (the rows last, so a crash between leaves no orphan
        rows)."""
        tar_path = self._batch(number, ".tar")
        size = tar_path.stat().st_size if tar_path.exists() else 0
        tar_path.unlink(missing_ok=True)
        self._batch(number, ".json").unlink(missing_ok=True)
        self.bytes -= size

    def tar_path(self, number: int) -> str:
        return str(self._batch(number, ".tar"))

    def _batch(self, number: int, suffix: str) -> Path:
        return self.dir / "batches" / f"{number:0{BATCH_DIGITS}d}{suffix}"

    # -- steps and the end ------------------------------------------------------------------------------

    def write_step(self, step: int, record: dict) -> None:
        self.write_json(f"steps/{step:0{BATCH_DIGITS}d}.json", record)

    def read_steps(self) -> list[dict]:
        """Every recorded step, in order (steps 0, 1, ...: a gap would be a lost record)."""
        paths = sorted((self.dir / "steps").glob("*.json"))
        steps = [json.loads(path.read_bytes()) for path in paths]
        if [int(path.stem) for path in paths] != list(range(len(paths))):
            raise SpoolError(f"the spool {self.dir} misses step records (found {[p.stem for p in paths][:8]}...)")
        return steps

    def write_json(self, name: str, value) -> None:
        self._write(self.dir / name, json.dumps(value, sort_keys=True).encode())

    def read_json(self, name: str):
        path = self.dir / name
        return json.loads(path.read_bytes()) if path.exists() else None

    def _write(self, path: Path, data: bytes) -> None:
        """The whole file or nothing: written under a temporary name, flushed to disk, renamed, the folder
        flushed (the rename itself durable)."""
        temporary = path.with_name(path.name + ".partial")
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise SpoolError(f"the live spool cannot write {path.name}: {error}") from None


def _npy(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> list[int]:
    """Add a member; its data's [offset, size] in the tar."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    blocks = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # the data, padded to whole blocks
    return [tar.offset - blocks, len(data)]


def read_member(path: str, span: list[int]) -> bytes:
    """A member's bytes by the [offset, size] its row recorded."""
    offset, size = span
    with open(path, "rb") as source:
        source.seek(offset)
        data = source.read(size)
    if len(data) != size:
        raise OSError(f"{path} ends before its member at {offset} (+{size})")
    return data


def read_array(path: str, span: list[int]) -> np.ndarray:
    return np.load(io.BytesIO(read_member(path, span)), allow_pickle=False)
