"""`packfeed convert internvl-meta META.json`: an InternVL data recipe -> one converted dataset per entry plus a
mixture file.

InternVL's meta file maps dataset names to {root, annotation, repeat_time, length, max_dynamic_patch, ...}:

    root               -> the image root of that dataset's JSONL annotation
    annotation         -> converted (format `internvl`) into DIR/NAME/ (shards, convert-report.json, index)
    repeat_time        -> `repeat:` of NAME in DIR/mixture.yaml (2 = twice per epoch, 0.3 = a seeded 30% subset)
    length             -> checked against the rows the annotation holds; a difference is reported
    max_dynamic_patch  -> that dataset's max tiles (`max_num` of the internvl image policy) when indexing

Other keys (data_augment, ...) are training-time options Packfeed does not apply; the report lists them.
Relative `root` and `annotation` paths count from the current directory, as InternVL resolves them, or from
`base` (`--image-root`) when given.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from packfeed.server.convert.convert import REPORT, ConvertOptions, ConvertReport, convert

MAPPED_KEYS = {"root", "annotation", "repeat_time", "length", "max_dynamic_patch"}


@dataclass(frozen=True)
class MetaDataset:
    name: str
    folder: str  # DIR/folder: the name with anything but letters, digits, `_`, `-` and `.` replaced
    root: str
    annotation: str
    repeat: float
    length: int | None
    max_dynamic_patch: int | None
    ignored: tuple[str, ...]


def read_meta(path: str | Path, base: str | Path | None = None) -> list[MetaDataset]:
    path, base = Path(path), Path(base or os.getcwd())
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: an InternVL meta file maps dataset names to {{root, annotation, repeat_time, ...}}")
    datasets, folders = [], set()
    for name, spec in raw.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("annotation"), str):
            raise ValueError(f"{path}: dataset {name!r} needs an `annotation` path")
        repeat = spec.get("repeat_time", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not math.isfinite(repeat) or repeat <= 0:
            raise ValueError(f"{path}: dataset {name!r} has repeat_time {repeat!r}; give a number > 0")
        patches = spec.get("max_dynamic_patch")
        if patches is not None and (isinstance(patches, bool) or not isinstance(patches, int) or patches < 1):
            raise ValueError(f"{path}: dataset {name!r} has max_dynamic_patch {patches!r}; give an integer >= 1")
        folder = re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip(".") or "dataset"
        if folder in folders:
            raise ValueError(f"{path}: datasets {name!r} and another map to the same folder {folder!r}; rename one")
        folders.add(folder)
        datasets.append(MetaDataset(
            name=str(name), folder=folder, root=str(base / spec.get("root", "")), annotation=str(base / spec["annotation"]),
            repeat=float(repeat), length=spec.get("length"), max_dynamic_patch=patches,
            ignored=tuple(sorted(set(spec) - MAPPED_KEYS))))
    return datasets


def convert_meta(meta: str | Path, out: str | Path, options: dict[str, Any],
                 index: Callable[[MetaDataset, ConvertReport], dict[str, Any]] | None = None,
                 base: str | Path | None = None) -> dict[str, Any]:
    """Convert every dataset of the meta file into `out/FOLDER/`, index each with `index(dataset, report)` when
    given, and write `out/mixture.yaml` and `out/convert-report.json` (per-dataset counts). `options`: the
    ConvertOptions fields shared by all datasets (shard size, workers, overwrite, progress)."""
    meta, out = Path(meta), Path(out)
    datasets = read_meta(meta, base)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"meta": str(meta.resolve()), "out": str(out.resolve()), "datasets": {}}
    for dataset in datasets:
        report = convert(ConvertOptions("internvl", dataset.annotation, str(out / dataset.folder),
                                        image_root=dataset.root, **options))
        entry = {"folder": dataset.folder, "rows": report.rows, "converted": report.converted,
                 "rejected": report.rejected, "rejected_by_reason": report.rejected_by_reason,
                 "repeat": dataset.repeat, "length": dataset.length,
                 "length_matches": dataset.length is None or dataset.length == report.rows,
                 "max_dynamic_patch": dataset.max_dynamic_patch, "ignored_keys": list(dataset.ignored)}
        if index is not None:
            entry["index"] = index(dataset, report)
        summary["datasets"][dataset.name] = entry
    mixture = {"name": meta.stem, "datasets": {d.name: {"index": f"{d.folder}/index.parquet", "repeat": d.repeat}
                                               for d in datasets}}
    (out / "mixture.yaml").write_text(yaml.safe_dump(mixture, sort_keys=False))
    (out / REPORT).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return summary


def policy_for(image_policy: dict[str, Any], dataset: MetaDataset) -> dict[str, Any]:
    """The image policy to index `dataset` with: its max_dynamic_patch as max tiles (internvl policy)."""
    if dataset.max_dynamic_patch is None or image_policy.get("name") != "internvl":
        return image_policy
    return {**image_policy, "max_num": dataset.max_dynamic_patch}

