"""Dataset mixtures planned as one: the union of their datasets' rows per epoch (`MixtureLoads`), read from a mixture
file (`packfeed.server.mixture.mixture_file`).

A repeat r gives every valid sample floor(r) times plus a subset of round((r - floor(r)) n) distinct valid
samples drawn from (seed, epoch, dataset), so counts are exact and deterministic. The epoch's rows are the
union of all datasets: ISF and balancing run over it, so packs mix datasets. A plan's row `k` is sample
`sample_ids[k]` of dataset `datasets[k]` (`MixtureRows`).

Weights that move (docs/planning.md "Mixtures that move"): a mixture whose datasets give `weights:` over the job is
planned in windows only, each drawing its rows by the weights at its middle (`packfeed.server.mixture.draws`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace

import numpy as np

from packfeed.media.chat import ChatTemplate
from packfeed.media.image_policy import policy_from_dict
from packfeed.server.index.table import IndexInfo
from packfeed.server.mixture.draws import DrawnColumn, MixtureDraws, Scheduled, WindowWeights
from packfeed.server.mixture.mixture_file import MAX_EPOCH_ROWS, Mixture
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.costs import SampleLoads, load_sample_loads
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mapped_loads import GatheredColumn, map_sample_loads, valid_mask
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import count_steps, make_plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.v1.options import PlanConfig

_SUBSET_STREAM = 0x5B5E7  # random stream of the subsets, apart from the planner's own

@dataclass
class MixtureRows:
    """One epoch of a mixture: the union's loads and, per row, its dataset and its sample id there."""

    loads: SampleLoads
    datasets: np.ndarray  # int32: position in `names`
    sample_ids: np.ndarray  # int64: row of that dataset's index
    names: list[str]

    def counts(self, members: np.ndarray) -> dict[str, int]:
        """How many of `members` (row ids) come from each dataset."""
        counted = np.bincount(self.datasets[members], minlength=len(self.names))
        return {name: int(count) for name, count in zip(self.names, counted)}


class MixtureLoads:
    """The indexes of a mixture, read once; `epoch(seed, epoch)` gives each epoch's rows."""

    def __init__(self, mixture: Mixture, read: list[tuple[SampleLoads, IndexInfo]] | None = None,
                 mapped: bool = False):
        """`read`: each dataset's (loads, index info) when the caller has them already; else they are read,
        into memory or (`mapped`) memory-mapped beside each index."""
        self.mixture = mixture
        read = read or [(map_sample_loads if mapped else load_sample_loads)(entry.index) for entry in mixture.datasets]
        self.loads = [loads for loads, _ in read]
        self.infos = [info for _, info in read]
        check_conventions(mixture, self.infos)
        for entry, info in zip(mixture.datasets, self.infos):
            if info.encoders:
                raise ValueError(f"{mixture.where(entry.name)}: its index names further encoders "
                                 f"({', '.join(sorted(info.encoders))}); a mixture plans the vision encoder and the "
                                 "LLM only: plan that index on its own")
        self.valid = [np.flatnonzero(valid_mask(loads)) for loads in self.loads]
        if mixture.schedule is None:
            check_epoch_rows(mixture, self.valid)
        self.samples = mixture.samples or sum(len(ids) for ids in self.valid)  # a moving mixture's epoch
        if mixture.schedule is not None and not 0 < self.samples <= MAX_EPOCH_ROWS:
            raise ValueError(f"{mixture.where()}: an epoch of {self.samples:,} samples; give `samples:` from 1 to "
                             f"{MAX_EPOCH_ROWS:,}")

    @property
    def moving(self) -> bool:
        """Its weights move over the epoch: it is planned in windows, each drawn by its own weights."""
        return self.mixture.schedule is not None

    @property
    def fingerprint(self) -> str:
        """Covers every dataset's name, index fingerprint and repeat (or the weight schedule and epoch length)."""
        basis = [{"name": e.name, "index": info.fingerprint, "repeat": e.repeat}
                 for e, info in zip(self.mixture.datasets, self.infos)]
        described = {"mixture": basis}
        if self.moving:
            schedule = self.mixture.schedule
            described["schedule"] = {"points": schedule.points, "interpolate": schedule.interpolate,
                                     "samples": self.samples}
            if self.mixture.rule is not None:  # the rule, never the losses
                described["rule"] = self.mixture.rule.to_dict()
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]

    def epoch(self, seed: int, epoch: int) -> MixtureRows:
        return self._rows(*self.epoch_rows(seed, epoch))

    def epoch_rows(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample id there) of every row of the epoch, in dataset order."""
        if self.moving:
            self._refuse_unwindowed()
        datasets, sample_ids = [], []
        for k, (entry, valid) in enumerate(zip(self.mixture.datasets, self.valid)):
            whole, fraction = divmod(entry.repeat, 1.0)
            picked = [valid] * int(whole)
            subset = int(round(fraction * len(valid)))
            if subset:
                rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, _SUBSET_STREAM, k]))
                picked.append(np.sort(rng.choice(valid, size=subset, replace=False)))
            rows = np.concatenate(picked) if picked else np.empty(0, np.int64)
            datasets.append(np.full(len(rows), k, dtype=np.int32))
            sample_ids.append(rows.astype(np.int64))
        return np.concatenate(datasets), np.concatenate(sample_ids)

    def windowed(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None = None,
                 ledger: WindowWeights | None = None) -> WindowedPlan:
        """The epoch planned window by window (`config.window` rows each) over its rows: as for one dataset,
        the rows' order is an affine permutation, so each window mixes every dataset in its share. Loads are
        read from each dataset's (memory-mapped) columns as a window needs them; the epoch's rows themselves
        are held (12 bytes a row). `ledger`: a loss-driven mixture's job's, which decides its windows 2 on
        (without one, as in the planning tools where no trainer reports losses: the schedule's weights)."""
        if self.moving:
            return self._moving_windows(config, seed, epoch, caps, ledger)
        datasets, sample_ids = self.epoch_rows(seed, epoch)
        rows = RowLoads(self.loads, datasets, sample_ids)
        return WindowedPlan(rows, config, seed, epoch, config.window, self.fingerprint, caps,
                            rows=MixtureRows(rows, datasets, sample_ids, [e.name for e in self.mixture.datasets]))

    def _moving_windows(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                        ledger: WindowWeights | None = None) -> WindowedPlan:
        """Each window's rows drawn by the weights at its middle; rows are numbered window after window. Caps are
        searched on every valid sample once, as for a whole-epoch mixture, so they suit every window's mix."""
        schedule = self.mixture.schedule
        if caps is None and not config.strategy.padded:  # not window 0's: its mix is only the schedule's start
            caps = resolve_caps(self.once().loads, config)
        source = ledger if ledger is not None else Scheduled(schedule.weights)  # the draws' one weight source
        draws = MixtureDraws(self.valid, self.samples, config.window, seed, epoch, source)
        datasets, sample_ids = DrawnColumn(draws, 0), DrawnColumn(draws, 1)
        rows = RowLoads(self.loads, datasets, sample_ids)
        return WindowedPlan(rows, config, seed, epoch, config.window, self.fingerprint, caps, drawn=True,
                            rows=MixtureRows(rows, datasets, sample_ids, [e.name for e in self.mixture.datasets]),
                            draws=draws, ledger=ledger)

    def drawn_epoch(self, config: PlanConfig, seed: int, epoch: int) -> tuple[MixtureRows, list[dict]]:
        """A moving mixture's epoch as its windows of `config.window` samples draw it: every drawn row (loads in
        memory), and each window's weights and draws (`MixtureDraws.describe`)."""
        if not config.window:
            self._refuse_unwindowed()
        draws = self._moving_windows(config, seed, epoch, None).draws
        drawn = [draws.rows(window) for window in range(draws.n_windows)]
        rows = self._rows(np.concatenate([d for d, _ in drawn]), np.concatenate([i for _, i in drawn]))
        return rows, [draws.describe(window, rows.names) for window in range(draws.n_windows)]

    def _refuse_unwindowed(self) -> None:
        raise ValueError(f"{self.mixture.where()}: its weights move over the epoch, so it is planned in windows, "
                         "each drawn by its own weights: give a window (--window N, `window` in the plan settings), "
                         "e.g. a twentieth of the epoch or less")

    def once(self) -> MixtureRows:
        """Every valid sample of every dataset once: what the automatic caps are searched on (stable across
        epochs, whatever the subsets)."""
        datasets = np.concatenate([np.full(len(v), k, dtype=np.int32) for k, v in enumerate(self.valid)])
        return self._rows(datasets, np.concatenate(self.valid).astype(np.int64))

    def _rows(self, datasets: np.ndarray, sample_ids: np.ndarray) -> MixtureRows:
        """The rows with every row's loads in memory (for planning the epoch whole)."""
        loads = RowLoads(self.loads, datasets, sample_ids).subset(np.arange(len(datasets)))
        return MixtureRows(loads, datasets, sample_ids, [e.name for e in self.mixture.datasets])


_LOAD_DTYPES = {"valid": bool, "vision": np.int32, "tokens": np.int32, "vit_patches": np.float32,
                "vit_attn_sq": np.float32, "towers": np.uint8}


class RowLoads:
    """An epoch's mixture rows as the loads a windowed plan reads (row k: sample `sample_ids[k]` of dataset
    `datasets[k]`), gathered from each dataset's loads, mapped or in memory, only for the rows asked for."""

    def __init__(self, parts: list, datasets: np.ndarray, sample_ids: np.ndarray):
        self.parts, self.datasets, self.sample_ids = parts, datasets, sample_ids
        for name in _LOAD_DTYPES:
            setattr(self, name, GatheredColumn(self, name))

    def __len__(self) -> int:
        return len(self.datasets)

    def gather(self, rows: np.ndarray, names=tuple(_LOAD_DTYPES)) -> dict[str, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        out = {name: np.empty(len(rows), dtype=_LOAD_DTYPES[name]) for name in names}
        if "valid" in out:
            out["valid"][:] = True  # an epoch's rows are valid samples only
        of_dataset = self.datasets[rows]
        wanted = tuple(name for name in names if name != "valid")
        for k, part in enumerate(self.parts):
            chosen = np.flatnonzero(of_dataset == k)
            if len(chosen) and wanted:  # one gather per dataset: a mapped one reads each batch once
                for name, values in part.gather(self.sample_ids[rows[chosen]], wanted).items():
                    out[name][chosen] = values
        return out

    def subset(self, rows: np.ndarray) -> SampleLoads:
        return SampleLoads(**self.gather(rows))


def check_epoch_rows(mixture: Mixture, valid: list[np.ndarray]) -> None:
    """An epoch whose rows cannot be held is refused before anything is allocated, naming its largest part."""
    rows = [entry.repeat * len(ids) for entry, ids in zip(mixture.datasets, valid)]
    for entry, ids in zip(mixture.datasets, valid):
        if ids.size and math.floor(entry.repeat) == 0 and round((entry.repeat % 1.0) * len(ids)) == 0:
            raise ValueError(f"{mixture.where(entry.name)}: repeat {entry.repeat:g} of its {len(ids):,} valid samples "
                             f"gives none per epoch; give at least {1 / len(ids):.3g}, or leave the dataset out")
    if sum(rows) > MAX_EPOCH_ROWS:
        largest = max(range(len(rows)), key=rows.__getitem__)
        entry = mixture.datasets[largest]
        raise ValueError(f"{mixture.where(entry.name)}: repeat {entry.repeat:g} x {len(valid[largest]):,} valid "
                         f"samples makes an epoch of {sum(rows):,.0f} rows with the others, over the "
                         f"{MAX_EPOCH_ROWS:,} one epoch can hold; lower the repeats")


def check_conventions(mixture: Mixture, infos: list[IndexInfo]) -> None:
    """Every dataset of a mixture feeds one model: same tokenizer, chat template and image policy family
    (per-dataset limits such as max tiles may differ)."""
    def conventions(info: IndexInfo) -> dict:
        template = ChatTemplate.from_dict(info.chat_template).to_dict() if info.chat_template else None
        return {"tokenizer": (info.tokenizer or {}).get("sha256"), "chat template": template,
                "image policy": policy_from_dict(info.image_policy).name}

    first, reference = mixture.datasets[0], conventions(infos[0])
    for entry, info in zip(mixture.datasets[1:], infos[1:]):
        for what, value in conventions(info).items():
            if value != reference[what]:
                raise ValueError(f"{mixture.where()}: datasets {first.name!r} and {entry.name!r} disagree on the "
                                 f"{what} ({reference[what]!r} vs {value!r}); index them with the same conventions")


def make_mixture_plan(mixture: MixtureLoads, config: PlanConfig, seed: int, epoch: int,
                      caps: Caps | None = None) -> Plan:
    """Plan one epoch of a mixture over the union of its datasets (caps: `_epoch_caps`)."""
    rows = mixture.epoch(seed, epoch)
    plan = make_plan(rows.loads, config, seed, epoch, mixture.fingerprint, caps=_epoch_caps(mixture, config, caps))
    return replace(plan, rows=rows)


def count_mixture_steps(mixture: MixtureLoads, config: PlanConfig, seed: int, epoch: int, caps: Caps | None) -> int:
    """The steps `make_mixture_plan` plans, counted (`planner.count_steps`)."""
    return count_steps(mixture.epoch(seed, epoch).loads, config, seed, epoch, _epoch_caps(mixture, config, caps))


def _epoch_caps(mixture: MixtureLoads, config: PlanConfig, caps: Caps | None) -> Caps | None:
    """`caps` when given (none for the padded strategies); else searched on every valid sample once, so they
    are the same in every epoch."""
    if caps is None and not config.strategy.padded:
        return resolve_caps(mixture.once().loads, config)
    return caps
