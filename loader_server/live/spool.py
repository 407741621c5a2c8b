"""A live job's spool: every sample a producer put, durable before the put is answered and kept until every rank
has acknowledged the step that took it, and each step's membership, recorded before any of the step is sent. A
server killed outright re-opens the job from its spool with nothing lost and nothing repeated.

A job's folder (ROOT/<job id, made safe>-<its digest>), plain files any tool reads:
    job.json           the job's settings, checked when a server opens the job on this spool again
    batches/B.T.tar    one put's accepted samples, a plain tar (T: a token of the write, so a tar a failed put
                       left behind never stands in the way of the next): per sample S (its place in the put, 6
                       digits) S.tokens.npy, S.loss_mask.npy, S.NAME.npy per tensor, S.token_versions.npy
                       (each token's policy version, when put with them) and S.K.img per image file
    batches/B.json     their rows: id, group, policy version, loads, their tar's name (`file`), each member's
                       offset and size in the tar; per-sample values; of a rollout put in parts its part, whether
                       it is unfinished and the digest its continuation starts with
    steps/S.json       step S's members (their ids, in the order planned from), the samples it dropped as stale
                       and those filter_groups dropped, whether it is the job's last, the policy version it is
                       trained by and its members' ages in versions
    released.json      the last step every rank acknowledged (the batches it consumed are gone)
    producer.json      the digest (SHA-256) of the job's producer token, when it was opened with one
A batch is durable once its rows exist: each file is written whole (a local file under a temporary name, flushed
to disk and renamed; an object in one PUT), the tar before its rows, and the rows never over a file that exists:
a put that failed or never answered leaves at most a tar no rows name, removed when a server takes the job (its
lease held: `recover`). The folder is local (a shared file system for a second server) or in an object store
(s3://bucket/prefix).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import secrets
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from packfeed.media.storage import ObjectError, ObjectNotFound, filesystem, is_object_url, read_range, retried
from packfeed.server.live.rows import LiveRow
from packfeed.server.live.spool_errors import SpoolConflict, SpoolError, SpoolFull  # noqa: F401  (its callers catch them here)
from packfeed.server.live.samples import LiveSample

BATCH_DIGITS = 12
TOKEN_VERSIONS = "token_versions"  # a sample's member of each token's policy version, when put with them


def job_folder(root: str | Path, job: str) -> str:
    """The job's folder under `root` (a path, or an object-store URL prefix)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]
    return f"{str(root).rstrip('/')}/{safe}-{hashlib.sha256(job.encode()).hexdigest()[:12]}"


class Spool:
    def __init__(self, root: str | Path, job: str, described: str):
        self.dir = job_folder(root, job)
        self.store = ObjectFolder(self.dir) if is_object_url(self.dir) else LocalFolder(self.dir)
        self.bytes = 0  # of the batches `recover` found and this server wrote since
        # media stored once per job: an image file's (content digest, size) -> where a held batch has it
        # (batch, tar, offset, size)
        self.media: dict[tuple[str, int], tuple[int, str, int, int]] = {}
        recorded = self.read_json("job.json")
        if recorded is None:
            self.write_json("job.json", {"job": job, "settings": json.loads(described)})
        elif recorded.get("settings") != json.loads(described):
            raise SpoolError(f"the spool {self.dir} holds job {job!r} with other settings "
                             f"({json.dumps(recorded.get('settings'), sort_keys=True)}): open it with those, or "
                             "use a new job id")

    # -- the producer token -----------------------------------------------------------------------------

    def claim_producer(self, token: str) -> str:
        """The digest of the job's producer token: `token`'s when the job has none yet (recorded: the first open
        that gives one sets it), else the one recorded ("": none). SpoolError when `token` is not the job's."""
        recorded = (self.read_json("producer.json") or {}).get("sha256", "")
        if not token:
            return recorded
        digest = token_digest(token)
        if not recorded:
            try:
                self.store.write("producer.json", json.dumps({"sha256": digest}).encode(), exclusive=True)
                return digest
            except SpoolConflict:  # another open set one meanwhile
                recorded = self.read_json("producer.json")["sha256"]
        if not hmac.compare_digest(recorded, digest):
            raise SpoolError(f"job {self.dir.rsplit('/', 1)[-1]!r} has another producer token: open it with the "
                             "job's own (or none, to join it), or use a new job id")
        return recorded

    # -- batches ----------------------------------------------------------------------------------------

    def recover(self) -> list[tuple[int, list[LiveRow]]]:
        """(number, rows) of every durable batch, in order; tars no rows name (puts that failed or never
        answered) are removed. Only for the job's lease holder: another server's put in flight would lose its tar."""
        batches = [(int(name[:-len(".json")]), [LiveRow.from_json(raw) for raw in json.loads(self.store.read(
            f"batches/{name}"))]) for name in self.store.list("batches", ".json")]
        named = {_tar_name(number, rows[0].file) for number, rows in batches if rows}
        for orphan in set(self.store.list("batches", ".tar")) - named:
            self.store.delete(f"batches/{orphan}")
        self.bytes = sum(self.store.size(f"batches/{name}") for name in named)
        self.media = {(digest, ref[3]): ref for _, rows in batches for row in rows
                      for digest, ref in zip(row.image_digests, row.own_image_refs()) if ref[0] == row.batch}
        return batches

    def write_batch(self, number: int, samples: list[LiveSample],
                    row_of: Callable[[str], LiveRow | None] = lambda sample_id: None) -> list[LiveRow]:
        """The samples as batch `number` (durable when this returns); their rows, as `recover` gives them. An
        image file is stored once per job however many samples or turns carry it (by its content's digest: one a
        batch still held has is read there, `media`); a fork's inherited images are its parent's (`row_of`: a
        spooled row by id, or one earlier in the batch).
        SpoolConflict when another server wrote batch `number`; SpoolError when the spool cannot keep them:
        nothing of them is kept then, and nothing stands in the way of writing the batch again."""
        name = f"{number:0{BATCH_DIGITS}d}.{secrets.token_hex(4)}.tar"
        rows: list[LiveRow] = []
        stored: dict[tuple[str, int], list[int]] = {}  # an image's (digest, size) -> its span in this tar

        def tar_of(out) -> None:  # written straight to the file: a put never holds a second copy of its samples
            stored.clear()  # (a retried write starts again)
            rows.clear()
            with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                by_id: dict[str, LiveRow] = {}
                for place, sample in enumerate(samples):
                    members = {"tokens": sample.tokens, "loss_mask": sample.loss_mask, **sample.tensors}
                    if sample.token_versions is not None:
                        members[TOKEN_VERSIONS] = sample.token_versions
                    spans = {member: _add(tar, f"{place:06d}.{member}.npy", _npy(values))
                             for member, values in members.items()}
                    images, digests, media = [], [], []
                    for k, data in enumerate(sample.images):
                        key = (xxhash.xxh3_128_hexdigest(data), len(data))
                        digests.append(key[0])
                        if key in self.media:  # spooled already, in a batch still held: read there
                            media.append((k, *self.media[key]))
                            continue
                        if key not in stored:
                            stored[key] = _add(tar, f"{place:06d}.{k}.img", data)
                        images.append(stored[key])
                    inherited = []
                    if sample.parent:
                        parent = by_id.get(sample.parent) or row_of(sample.parent)
                        inherited = parent.image_refs()[:sample.inherited_images]
                    rows.append(LiveRow.spooled(sample, number, name, place, spans, images, inherited, digests, media))
                    by_id[sample.id] = rows[-1]

        size = self.store.write(f"batches/{name}", tar_of, exclusive=True)  # the tar before its rows (rows: durable)
        try:  # never over rows another server wrote (`exclusive`)
            self.store.write(self._rows(number), json.dumps([row.to_json() for row in rows]).encode(), exclusive=True)
        except SpoolError:
            self._forget_tar(name)
            raise
        self.bytes += size
        self.media.update({key: (number, name, *span) for key, span in stored.items()})
        return rows

    def _forget_tar(self, name: str) -> None:
        """A tar whose rows could not be written: removed now if the store lets us, else by the next `recover`
        (no rows name it, and its name is this write's alone)."""
        try:
            self.store.delete(f"batches/{name}")
        except (OSError, ObjectError):
            pass

    def remove_batch(self, number: int, file: str) -> None:
        """A batch every rank has consumed (`file`: its tar's name, its rows' `file`): its files go (the tar first:
        rows without a tar are never read again, a tar without rows is a failed put's, removed by `recover`)."""
        self.media = {key: ref for key, ref in self.media.items() if ref[0] != number}
        tar = f"batches/{_tar_name(number, file)}"
        size = self.store.size(tar)
        self.store.delete(tar)
        self.store.delete(self._rows(number))
        self.bytes -= size

    def tar_path(self, row: LiveRow) -> str:
        """Where a worker reads a row's members (a path, or an object URL)."""
        return f"{self.dir}/batches/{_tar_name(row.batch, row.file)}"

    @staticmethod
    def _rows(number: int) -> str:
        return f"batches/{number:0{BATCH_DIGITS}d}.json"

    # -- steps and the end ------------------------------------------------------------------------------

    def write_step(self, step: int, record: dict) -> None:
        self.store.write(f"steps/{step:0{BATCH_DIGITS}d}.json", json.dumps(record, sort_keys=True).encode(),
                         exclusive=True)

    def read_steps(self) -> list[dict]:
        """Every recorded step, in order (steps 0, 1, ...: a gap would be a lost record)."""
        names = self.store.list("steps", ".json")
        if [int(name[:-len(".json")]) for name in names] != list(range(len(names))):
            raise SpoolError(f"the spool {self.dir} misses step records (found {names[:8]}...)")
        return [json.loads(self.store.read(f"steps/{name}")) for name in names]

    @staticmethod
    def taken_by(record: dict) -> list[str]:
        """Every sample a step record took off the pending queue: its members, the samples it dropped as stale and
        those of the groups filter_groups dropped (a record from before filtered groups has none)."""
        return record["members"] + record["dropped"] + record.get("filtered", [])

    def write_json(self, name: str, value) -> None:
        self.store.write(name, json.dumps(value, sort_keys=True).encode())

    def read_json(self, name: str):
        data = self.store.read(name, missing_ok=True)
        return None if data is None else json.loads(data)


class LocalFolder:
    """A spool in a local folder (or a shared file system): each file written whole under a temporary name,
    flushed to disk and renamed, the folder flushed too (the rename itself durable)."""

    def __init__(self, root: str):
        self.root = Path(root)
        try:
            for folder in ("batches", "steps"):
                (self.root / folder).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SpoolError(f"cannot create the live spool {self.root}: {error}") from None

    def write(self, name: str, data: bytes | Callable[[BinaryIO], None], exclusive: bool = False) -> int:
        """Write `data` (bytes, or a function writing them to a file object) whole; its size. `exclusive`: never
        over an existing file (a batch or step another server wrote: this one lost the job's lease without knowing
        yet); SpoolConflict then, and nothing written."""
        path = self.root / name
        temporary = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            with open(temporary, "wb") as out:
                data(out) if callable(data) else out.write(data)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            if exclusive:
                try:
                    os.link(temporary, path)  # fails when the name exists, atomically
                except FileExistsError:
                    raise SpoolConflict(f"the live spool already holds {path}, written by another server after "
                                        "this one read the job") from None
                finally:
                    temporary.unlink(missing_ok=True)
            else:
                os.replace(temporary, path)
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise SpoolError(f"the live spool cannot write {path}: {error}") from None
        return size

    def read(self, name: str, missing_ok: bool = False) -> bytes | None:
        path = self.root / name
        if missing_ok and not path.exists():
            return None
        return path.read_bytes()

    def list(self, folder: str, suffix: str) -> list[str]:
        return sorted(path.name for path in (self.root / folder).glob(f"*{suffix}"))

    def size(self, name: str) -> int:
        path = self.root / name
        return path.stat().st_size if path.exists() else 0

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


class ObjectFolder:
    """A spool in an object store (s3://bucket/prefix, gs://, az://): a PUT writes an object whole or not at all,
    so each file is one PUT; reads and listings go to the store (never a cached listing)."""

    def __init__(self, root: str):
        self.root = root
        self.fs = filesystem(root)

    def write(self, name: str, data: bytes | Callable[[BinaryIO], None], exclusive: bool = False) -> int:
        """One PUT of `data` (bytes, or a function writing them to a file object); its size. `exclusive` is not
        checked: an object store spool relies on the job's lease alone."""
        url = f"{self.root}/{name}"
        if callable(data):
            buffer = io.BytesIO()
            data(buffer)
            data = buffer.getvalue()
        try:
            retried(url, "writing", self.fs.pipe_file, url, data)
        except ObjectError as error:
            raise SpoolError(f"the live spool cannot write {url}: {error}") from None
        return len(data)

    def read(self, name: str, missing_ok: bool = False) -> bytes | None:
        url = f"{self.root}/{name}"
        try:
            return retried(url, "reading", self.fs.cat_file, url)
        except ObjectNotFound:
            if missing_ok:
                return None
            raise

    def list(self, folder: str, suffix: str) -> list[str]:
        url = f"{self.root}/{folder}"
        self.fs.invalidate_cache(url)
        try:
            found = retried(url, "listing", self.fs.ls, url, detail=False)
        except ObjectNotFound:
            return []
        return sorted(name.rsplit("/", 1)[-1] for name in found if name.endswith(suffix))

    def size(self, name: str) -> int:
        url = f"{self.root}/{name}"
        try:
            return int(retried(url, "reading the metadata of", self.fs.info, url).get("size") or 0)
        except ObjectNotFound:
            return 0

    def delete(self, name: str) -> None:
        url = f"{self.root}/{name}"
        try:
            retried(url, "removing", self.fs.rm_file, url)
        except ObjectNotFound:
            pass


def token_digest(token: str) -> str:
    """What the spool keeps of a producer token, and what a put's token is compared by."""
    return hashlib.sha256(token.encode()).hexdigest()


def beside(tar: str, file: str) -> str:
    """Where batch tar `file` lies, in the folder of the batch tar `tar` (a path or an object URL)."""
    return f"{tar.rsplit('/', 1)[0]}/{file}"


def _tar_name(number: int, file: str) -> str:
    """The name of a batch's tar (`file` in its rows; a spool written before tars had a token: B.tar)."""
    return file or f"{number:0{BATCH_DIGITS}d}.tar"


def _npy(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes | memoryview) -> list[int]:
    """Add a member; its data's [offset, size] in the tar."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    blocks = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # the data, padded to whole blocks
    return [tar.offset - blocks, len(data)]


def read_member(path: str, span: list[int]) -> bytes:
    """A member's bytes by the [offset, size] its row recorded (one range request in an object store)."""
    offset, size = span
    if is_object_url(path):
        data = read_range(path, offset, size)
        if len(data) != size:
            raise OSError(f"{path} ends before its member at {offset} (+{size})")
        return data
    with open(path, "rb") as source:
        source.seek(offset)
        data = source.read(size)
    if len(data) != size:
        raise OSError(f"{path} ends before its member at {offset} (+{size})")
    return data


def read_array(path: str, span: list[int]) -> np.ndarray:
    return np.load(io.BytesIO(read_member(path, span)), allow_pickle=False)
