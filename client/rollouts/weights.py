"""A policy's weights by version, in a folder or an object-store prefix: the trainer publishes each version
(`WeightVersions.publish`, safetensors), and rollout processes load the newest, or wait for the one a grant names
(docs/live.md "Weights by version").

    versions = WeightVersions("s3://bucket/run-7/weights")       # or a local (shared) folder
    versions.publish(model.state_dict(), version)                 # the trainer, after each update (rank 0)
    version, state = versions.load()                              # a rollout process: the newest
    state = versions.wait_for(grant.policy_version, timeout_s=600)

The folder holds `v<version>.safetensors` (one file per version, written whole: a local file under a temporary
name, flushed and renamed; an object in one PUT) and `latest.json` ({"version": V, "file": ...}), written after
its file, so a reader never finds a version named before it is whole. `keep` versions are kept (the older go).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from packfeed.media.storage import filesystem, is_object_url

LATEST = "latest.json"


class WeightVersions:
    def __init__(self, root: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError("keep at least one version (keep >= 1)")
        self.root, self.keep = str(root).rstrip("/"), keep
        if not is_object_url(self.root):
            Path(self.root).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def file_of(version: int) -> str:
        return f"v{version:010d}.safetensors"

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """Write `version`'s weights, then name it the newest; where they are. Tensors that share storage (tied
        embeddings) are each written whole."""
        from safetensors.torch import save

        if version < 0:
            raise ValueError(f"a policy version is >= 0, not {version}")
        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state_dict.items()}
        name = self.file_of(version)
        self._write(name, save(tensors, metadata={"policy_version": str(version)}))
        self._write(LATEST, json.dumps({"version": version, "file": name}).encode())
        self._prune(version)
        return f"{self.root}/{name}"

    def newest(self) -> int | None:
        """The newest published version (None: none yet)."""
        data = self._read(LATEST)
        return None if data is None else int(json.loads(data)["version"])

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, its weights): `version`'s, or the newest. FileNotFoundError when it is not there (never
        published, or pruned: `keep`)."""
        from safetensors.torch import load

        version = self.newest() if version is None else version
        data = None if version is None else self._read(self.file_of(version))
        if data is None:
            raise self._missing(version)
        return version, load(data)

    def wait_for(self, version: int, timeout_s: float = 600.0, poll_s: float = 0.2) -> dict[str, torch.Tensor]:
        """`version`'s weights once published (a grant names a version the trainers hold: its file is written
        before they say so, unless the writer is behind); TimeoutError after `timeout_s`."""
        self.wait_published(version, timeout_s, poll_s)
        return self.load(version)[1]

    def wait_published(self, version: int, timeout_s: float = 600.0, poll_s: float = 0.2) -> None:
        """Return once `version` (or a newer one) is published; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            newest = self.newest()
            if newest is not None and newest >= version:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} was not published under {self.root} within {timeout_s:g} s "
                                   f"(the newest: {newest})")
            time.sleep(poll_s)

    def place(self, version: int, path: Path) -> None:
        """`version`'s file at `path` (for an engine that reads weights from its own disk): linked from a local
        folder where it can be, else copied or downloaded. FileNotFoundError when it is not there."""
        name = self.file_of(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        if is_object_url(self.root):
            try:
                filesystem(self.root).get_file(f"{self.root}/{name}", str(path))
                return
            except FileNotFoundError:
                raise self._missing(version) from None
        source = Path(self.root) / name
        try:
            os.link(source, path)  # the version's file itself: no copy, and pruning it leaves this name whole
        except FileNotFoundError:
            raise self._missing(version) from None
        except OSError:  # another filesystem
            shutil.copyfile(source, path)

    def _missing(self, version: int | None) -> FileNotFoundError:
        return FileNotFoundError(f"no weights of version {version} under {self.root} (published: "
                                 f"{self.newest()}; the newest {self.keep} are kept)")

    def _write(self, name: str, data: bytes) -> None:
        if is_object_url(self.root):
            filesystem(self.root).pipe_file(f"{self.root}/{name}", data)
            return
        path = Path(self.root) / name
        temporary = path.with_name(f".{name}.{os.getpid()}.partial")
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)

    def _read(self, name: str) -> bytes | None:
        if is_object_url(self.root):
            fs = filesystem(self.root)
            fs.invalidate_cache(self.root)
            try:
                return fs.cat_file(f"{self.root}/{name}")
            except FileNotFoundError:
                return None
        path = Path(self.root) / name
        return path.read_bytes() if path.exists() else None

    def _prune(self, newest: int) -> None:
        """The versions older than the newest `keep` go (a reader loading one of them finds it gone: it loads the
        newest instead)."""
        if is_object_url(self.root):
            fs = filesystem(self.root)
            names = [n.rsplit("/", 1)[-1] for n in fs.ls(self.root, detail=False)]
        else:
            fs, names = None, os.listdir(self.root)
        for name in names:
            if name.startswith("v") and name.endswith(".safetensors") and int(name[1:11]) <= newest - self.keep:
                if fs is None:
                    (Path(self.root) / name).unlink(missing_ok=True)
                else:
                    fs.rm_file(f"{self.root}/{name}")
