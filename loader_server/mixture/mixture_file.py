"""A mixture file: several indexes, each with a repeat weight (InternVL's `repeat_time`) or weights that move over
the job (docs/planning.md "Mixtures" and "Mixtures that move"), read and checked before anything is planned. How
its epochs are drawn and planned: `packfeed.server.mixture.loads`.

    name: sft-mix
    datasets:
      chartqa: {index: chartqa/index.parquet, repeat: 2}     # every valid sample twice per epoch
      ai2d:    {index: ai2d/index.parquet, repeat: 1}
      docvqa:  {index: docvqa/index.parquet, repeat: 0.4}    # a seeded subset of round(0.4 n), new each epoch

    name: anneal
    interpolate: linear          # or step
    samples: 2000000             # the epoch's length (default: the datasets' valid samples summed)
    datasets:
      ocr:  {index: ocr/index.parquet,  weights: {0.0: 0.8, 1.0: 0.2}}
      chat: {index: chat/index.parquet, weights: {0.0: 0.2, 1.0: 0.8}}

Relative index paths count from the mixture file; every error names the file and the dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from packfeed.server.index.table import read_index_info
from packfeed.server.mixture.schedule import WeightSchedule
from packfeed.server.mixture.weight_rules import WeightRule
MAX_REPEAT = 1000  # a dataset seen more often than this per epoch is a typo, not a weight (InternVL's go to ~4)
MAX_EPOCH_ROWS = 1 << 31  # rows of one epoch: each costs 12 bytes held, and the planner counts them in int32


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path, what: str) -> object:
    """A settings file (a mixture, the server's config): YAML with unique keys; errors name the file."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{what} {path}: cannot be read as YAML ({error})") from None


@dataclass(frozen=True)
class MixtureEntry:
    name: str
    index: str
    repeat: float


_MIXTURE_KEYS = {"name", "datasets", "interpolate", "samples", "rule"}


@dataclass(frozen=True)
class Mixture:
    name: str
    datasets: tuple[MixtureEntry, ...]
    path: str = ""  # the file it was read from, for errors
    schedule: WeightSchedule | None = None  # weights that move over the epoch (then `repeat` is unused)
    samples: int = 0  # a moving mixture's epoch length; 0: its datasets' valid samples summed
    rule: WeightRule | None = None  # weights the reported losses move, from the schedule's (docs: "Weights the loss moves")

    @classmethod
    def load(cls, path: str | Path) -> Mixture:
        """Read and check a mixture file (YAML)."""
        path = Path(path)
        raw = read_yaml(path, "mixture file") or {}
        if not isinstance(raw, dict) or not isinstance(raw.get("datasets"), dict) or not raw["datasets"]:
            raise ValueError(f"{path}: a mixture file needs `name:` and `datasets: {{NAME: {{index: PATH, "
                             "repeat: FLOAT}}}` (or `weights: {PROGRESS: WEIGHT}` per dataset)")
        if set(raw) - _MIXTURE_KEYS:
            raise ValueError(f"mixture file {path}: unknown keys {sorted(map(str, set(raw) - _MIXTURE_KEYS))}; a "
                             f"mixture file has {', '.join(sorted(_MIXTURE_KEYS))}")
        name = str(raw.get("name") or path.stem)
        specs = raw["datasets"]
        moving = [isinstance(spec, dict) and "weights" in spec for spec in specs.values()]
        if any(moving) and not all(moving):
            still = [str(d) for d, m in zip(specs, moving) if not m]
            raise ValueError(f"mixture file {path}: datasets {still} give no `weights:` while others do; give every "
                             "dataset weights over the job, or every dataset a repeat")
        if any(moving):
            return cls._moving(path, name, raw)
        if "interpolate" in raw or "samples" in raw or "rule" in raw:
            raise ValueError(f"mixture file {path}: `interpolate:`, `samples:` and `rule:` go with datasets' "
                             "`weights:`; a mixture of repeats has none of them")
        entries = [MixtureEntry(str(dataset), str(_index_path(path, dataset, spec)), _repeat(path, dataset, spec))
                   for dataset, spec in specs.items()]
        return cls(name, tuple(entries), str(path))

    @classmethod
    def _moving(cls, path: Path, name: str, raw: dict) -> Mixture:
        specs = raw["datasets"]
        for dataset, spec in specs.items():
            if "repeat" in spec:
                raise ValueError(f"mixture file {path}: dataset {dataset!r} gives both `repeat:` and `weights:`; "
                                 "weights that move replace the repeat")
        schedule = WeightSchedule.parse({d: spec["weights"] for d, spec in specs.items()},
                                        raw.get("interpolate", "linear"), f"mixture file {path}")
        samples = raw.get("samples", 0)
        if "samples" in raw and (isinstance(samples, bool) or not isinstance(samples, int)
                                 or not 0 < samples <= MAX_EPOCH_ROWS):
            raise ValueError(f"mixture file {path}: samples {samples!r}; give the epoch's length, a whole "
                                 f"number of samples from 1 to {MAX_EPOCH_ROWS:,}")
        entries = [MixtureEntry(str(dataset), str(_index_path(path, dataset, spec)), 1.0)
                   for dataset, spec in specs.items()]
        rule = WeightRule.parse(raw["rule"], list(map(str, specs)), f"mixture file {path}") if "rule" in raw else None
        return cls(name, tuple(entries), str(path), schedule, samples, rule)

    def where(self, dataset: str | None = None) -> str:
        """How errors name the mixture (its file when read from one) and the dataset."""
        named = f"mixture file {self.path}" if self.path else f"mixture {self.name}"
        return f"{named}: dataset {dataset!r}" if dataset is not None else named


def _index_path(path: Path, dataset, spec) -> Path:
    if not isinstance(spec, dict) or "index" not in spec or set(spec) - {"index", "repeat", "weights"}:
        raise ValueError(f"mixture file {path}: dataset {dataset!r} needs `index:` and optionally `repeat:` or "
                         "`weights:`, nothing else")
    if not isinstance(spec["index"], str) or not spec["index"]:
        raise ValueError(f"mixture file {path}: dataset {dataset!r} has index {spec['index']!r}; give the path of "
                         "its index.parquet")
    index = Path(spec["index"])
    index = index if index.is_absolute() else path.parent / index
    if not index.is_file():
        raise ValueError(f"mixture file {path}: dataset {dataset!r}: index {index} not found")
    try:
        read_index_info(index)
    except ValueError as error:  # it names the file; the mixture names the dataset
        raise ValueError(f"mixture file {path}: dataset {dataset!r}: {error}") from None
    return index


def _repeat(path: Path, dataset, spec: dict) -> float:
    """The dataset's repeat weight: a number in (0, MAX_REPEAT] (YAML's true or "two" are refused; `1e3`, which
    YAML reads as a string, is the number 1000)."""
    given = spec.get("repeat", 1)
    repeat = math.nan
    if isinstance(given, (int, float, str)) and not isinstance(given, bool):
        try:
            repeat = float(given)
        except ValueError:
            pass
    if not math.isfinite(repeat) or not 0 < repeat <= MAX_REPEAT:
        raise ValueError(f"mixture file {path}: dataset {dataset!r} has repeat {given!r}; give a number > 0 and "
                         f"at most {MAX_REPEAT} (times each sample is seen per epoch)")
    return repeat
