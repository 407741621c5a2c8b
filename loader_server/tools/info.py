"""`packfeed info PATH`: the quick look a person takes before training, like `energon info`.

PATH is an index (counts, valid and invalid samples by reason, distributions of images, vision units, LLM and
loss tokens, the conventions it was built with), a mixture file (the same per dataset, with its repeat and
samples per epoch), a directory (its `index.parquet`, else its tar shards), a live job's spool folder (its
samples spooled and pending, steps formed, stale drops) or shards (what can be seen without a tokenizer: samples,
members, images per sample, problems).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from packfeed.media.samples import reason_category
from packfeed.server.index.table import read_index

INDEX_COLUMNS = ["valid", "reason", "n_images", "n_videos", "vision_units", "llm_tokens", "loss_tokens", "shard"]


def describe(values: np.ndarray) -> dict[str, float]:
    """min, mean, p50, p90, p99, max of `values` ({} when empty)."""
    if len(values) == 0:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": round(float(values.mean()), 2), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(values.max()), "min": float(values.min())}


def index_info(path: str | Path) -> dict[str, Any]:
    table, info = read_index(path, columns=INDEX_COLUMNS)
    column = {name: table.column(name).to_numpy(zero_copy_only=False) for name in INDEX_COLUMNS
              if name not in ("reason", "shard")}
    valid = column["valid"].astype(bool)
    reasons = Counter(reason_category(r) for r in table.column("reason").to_pylist() if r is not None)
    distributions = {name: describe(column[name][valid].astype(np.int64))
                     for name in ("vision_units", "llm_tokens", "loss_tokens")}
    if info.has_shards:
        distributions = {"images_per_sample": describe(column["n_images"][valid].astype(np.int64)),
                         "videos_per_sample": describe(column["n_videos"][valid].astype(np.int64)), **distributions}
    return {"kind": "index", "path": str(path), "fingerprint": info.fingerprint, "source": info.source,
            "samples": int(len(valid)), "valid": int(valid.sum()), "invalid": int((~valid).sum()),
            "invalid_by_reason": dict(sorted(reasons.items())), "shards": len(info.inputs),
            "shard_errors": info.skipped_shards or [], "distributions": distributions, "trees": _trees(path, info),
            "preprocessing_ms": _preprocessing(path) if info.has_shards else {},
            "conventions": {"image_policy": info.image_policy, "video_policy": info.video_policy,
                            "chat_template": info.chat_template,
                            "tokenizer": (info.tokenizer or {}).get("path")}}


def _preprocessing(path: str | Path) -> dict[str, Any]:
    """Per pixel mode this machine has a calibration of (`packfeed calibrate`), the samples' predicted ms."""
    from packfeed.server.tools.loader_cores import preprocessing_ms
    from packfeed.v1.options import PixelMode

    return {mode: found["ms_per_sample"] for mode, found in preprocessing_ms(path, list(PixelMode), False).items()}


def _trees(path: str | Path, info) -> dict[str, Any] | None:
    """An index of trees: its forks (samples continuing another), the trees they make, and the samples naming a
    parent that are served whole, by reason (`packfeed.server.index.trajectories`)."""
    if not info.trees:
        return None
    table, _ = read_index(path, columns=["parent", "group"])
    parent, group = (table.column(name).to_numpy(zero_copy_only=False) for name in ("parent", "group"))
    return {"forks": int((parent >= 0).sum()), "trees": int(len(np.unique(group[parent >= 0]))),
            "forks_alone": info.forks_alone or {}}


def mixture_info(path: str | Path) -> dict[str, Any]:
    from packfeed.server.mixture.mixture_file import Mixture
    from packfeed.server.mixture.loads import MixtureLoads

    mixture = Mixture.load(path)
    loads = MixtureLoads(mixture)
    datasets = {}
    for entry in mixture.datasets:
        one = index_info(entry.index)
        whole, fraction = divmod(entry.repeat, 1.0)
        one.update(repeat=entry.repeat, samples_per_epoch=int(whole) * one["valid"] + round(fraction * one["valid"]))
        datasets[entry.name] = one
    return {"kind": "mixture", "path": str(path), "name": mixture.name, "fingerprint": loads.fingerprint,
            "samples_per_epoch": sum(d["samples_per_epoch"] for d in datasets.values()), "datasets": datasets}


def shards_info(specs: list[str]) -> dict[str, Any]:
    from packfeed.server.index.shards import ShardError, expand_shards, is_compressed, iter_samples

    urls = expand_shards(specs)
    samples, members, without_json, images, problems, seen, duplicates = 0, 0, 0, [], [], set(), 0
    for url in urls:
        if is_compressed(url):
            problems.append({"shard": url, "problem": "compressed: serving needs plain .tar shards"})
        try:
            for raw in iter_samples(url):
                samples += 1
                members += len(raw.members)
                images.append(len(raw.image_members()))
                without_json += raw.json_member() is None
                duplicates += raw.key in seen
                seen.add(raw.key)
        except ShardError as error:
            problems.append({"shard": url, "problem": str(error)})
    return {"kind": "shards", "shards": len(urls), "samples": samples, "members": members,
            "without_json": without_json, "duplicate_keys": duplicates,
            "distributions": {"images_per_sample": describe(np.asarray(images, dtype=np.int64))},
            "problems": problems, "note": "index the shards (`packfeed index`) for tokens, tiles and validity"}


def spool_info(folder: Path) -> dict[str, Any]:
    """A live job's spool folder (`packfeed serve --live-spool`), read without changing it: the job's settings,
    its samples spooled and pending, its steps, stale drops and whether it ended."""
    import json

    from packfeed.server.live.spool import Spool

    settings = json.loads((folder / "job.json").read_text())
    latest: dict[str, dict] = {}  # a rollout put in parts by its latest part (those before are superseded)
    for path in sorted((folder / "batches").glob("*.json")):
        for row in json.loads(path.read_text()):
            latest[row["id"]] = row
    rows = [row for row in latest.values() if not row.get("unfinished")]
    steps = [json.loads(path.read_text()) for path in sorted((folder / "steps").glob("*.json"))]
    taken = {sample_id for record in steps for sample_id in Spool.taken_by(record)}
    released = json.loads((folder / "released.json").read_text())["step"] if (folder / "released.json").exists() \
        else -1
    ages: Counter = Counter()
    for record in steps:
        ages.update({int(age): n for age, n in record.get("ages", {}).items()})
    return {"kind": "live spool", "path": str(folder), "job": settings["job"], "settings": settings["settings"],
            "batches": len(list((folder / "batches").glob("*.tar"))),
            "spool_bytes": sum(path.stat().st_size for path in (folder / "batches").glob("*.tar")),
            "samples_spooled": len(rows), "pending": sum(row["id"] not in taken for row in rows),
            "steps": len(steps), "released_through": released,
            "dropped_stale": sum(len(record["dropped"]) for record in steps),
            "ended": bool(steps) and steps[-1]["last"],
            # asynchronous RL: the version the last step trains at, trained samples by age in versions, rollouts
            # put unfinished and not yet continued, groups filtered or taken short, and who put what is spooled
            "versions": {"last_step_trained_by": steps[-1].get("version") if steps else None,
                         "trained_age": dict(sorted(ages.items()))},
            "partials": {"unfinished": sum(bool(row.get("unfinished")) for row in latest.values()),
                         "parts_finished": sum(row.get("part", 0) > 0 for row in rows)},
            "groups": {"filtered": sum(record.get("filtered_groups", 0) for record in steps),
                       "short": sum(record.get("short_groups", 0) for record in steps)},
            "producers": dict(Counter(row.get("producer") or "(unnamed)" for row in latest.values())),
            "distributions": {"llm_tokens": describe(np.array([row["tokens"] for row in rows], dtype=np.int64)),
                              "vision_units": describe(np.array([row["vision"] for row in rows], dtype=np.int64))}}


def describe_path(path: str) -> dict[str, Any]:
    """What `packfeed info` reports of PATH (an index, a mixture file, a directory, a live job's spool folder,
    or shards)."""
    target = Path(path)
    if target.is_dir() and (target / "job.json").is_file() and (target / "batches").is_dir():
        return spool_info(target)
    if target.suffix in (".yaml", ".yml"):
        return mixture_info(target)
    if target.is_dir():
        if (target / "index.parquet").is_file():
            return index_info(target / "index.parquet")
        shards = sorted(str(p) for p in target.glob("*.tar"))
        if not shards:
            raise ValueError(f"{path} holds neither index.parquet nor .tar shards")
        return shards_info(shards)
    if target.suffix == ".parquet":
        return index_info(target)
    return shards_info([path])


def format_info(data: dict[str, Any], indent: str = "") -> str:
    """The report as a person reads it."""
    lines = []
    if data["kind"] == "mixture":
        lines.append(f"{indent}mixture {data['name']} ({data['path']}), fingerprint {data['fingerprint']}: "
                     f"{data['samples_per_epoch']:,} samples per epoch")
        for name, one in data["datasets"].items():
            lines.append(f"{indent}  {name}: repeat {one['repeat']:g} -> {one['samples_per_epoch']:,} per epoch")
            lines.append(format_info(one, indent + "    "))
        return "\n".join(lines)
    if data["kind"] == "live spool":
        lines.append(f"{indent}live job {data['job']!r} spool {data['path']}: {data['samples_spooled']:,} samples "
                     f"in {data['batches']} batches ({data['spool_bytes'] / 2**20:.1f} MiB), {data['pending']:,} "
                     f"pending; {data['steps']} steps formed (consumed by every rank through step "
                     f"{data['released_through']}), {data['dropped_stale']:,} samples dropped as stale"
                     + ("; ended" if data["ended"] else ""))
        versions, partials, groups = data["versions"], data["partials"], data["groups"]
        ages = ", ".join(f"{age}: {n:,}" for age, n in versions["trained_age"].items()) or "none yet"
        lines.append(f"{indent}versions: the last step trains version {versions['last_step_trained_by']}; samples "
                     f"by age in versions {ages}; {partials['unfinished']:,} unfinished rollouts, "
                     f"{partials['parts_finished']:,} finished from parts; {groups['filtered']:,} groups filtered, "
                     f"{groups['short']:,} taken short")
        lines.append(f"{indent}producers: " + ", ".join(f"{name} ({n:,} spooled)"
                                                        for name, n in data["producers"].items()))
    elif data["kind"] == "shards":
        lines.append(f"{indent}{data['shards']} shards, {data['samples']:,} samples, {data['members']:,} members; "
                     f"{data['without_json']} without json, {data['duplicate_keys']} duplicate keys")
    else:
        lines.append(f"{indent}index {data['path']} ({data['source']}, {data['shards']} inputs), fingerprint "
                     f"{data['fingerprint']}")
        lines.append(f"{indent}{data['samples']:,} samples: {data['valid']:,} valid, {data['invalid']:,} invalid")
        lines += [f"{indent}  {count:,} {reason}" for reason, count in data["invalid_by_reason"].items()]
        if data.get("trees"):
            trees = data["trees"]
            lines.append(f"{indent}{trees['forks']:,} samples continue another, in {trees['trees']:,} trees (each "
                         f"shared turn planned and served once); "
                         f"{sum(trees['forks_alone'].values()):,} naming a parent are served whole")
            lines += [f"{indent}  {count:,} {reason}" for reason, count in trees["forks_alone"].items()]
    for name, stats in data["distributions"].items():
        if stats:
            lines.append(f"{indent}{name}: min {stats['min']:g}, p50 {stats['p50']:g}, p90 {stats['p90']:g}, "
                         f"p99 {stats['p99']:g}, max {stats['max']:g} (mean {stats['mean']:g})")
    if data["kind"] == "index" and data.get("preprocessing_ms") is not None and "samples" in data:
        found = data["preprocessing_ms"]
        lines += [f"{indent}preprocessing ms per sample ({mode}, this machine): p50 {ms['p50']:g}, p99 {ms['p99']:g}, "
                  f"max {ms['max']:g} (mean {ms['mean']:g})" for mode, ms in found.items() if ms]
        if not found and data["source"] == "shards":
            lines.append(f"{indent}preprocessing cost: run `packfeed calibrate` to see it for this machine")
    for problem in data.get("problems", []) + data.get("shard_errors", []):
        lines.append(f"{indent}problem: {problem}")
    if data["kind"] == "index" and data["conventions"]["image_policy"]:
        policy = dict(data["conventions"]["image_policy"])
        settings = ", ".join(f"{k} {v}" for k, v in policy.items() if k != "name")
        lines.append(f"{indent}image policy {policy.get('name')} ({settings}); tokenizer {data['conventions']['tokenizer']}")
        if data["conventions"].get("video_policy") and data["distributions"].get("videos_per_sample", {}).get("max"):
            video = ", ".join(f"{k} {v}" for k, v in data["conventions"]["video_policy"].items())
            lines.append(f"{indent}video policy ({video})")
    return "\n".join(lines)
