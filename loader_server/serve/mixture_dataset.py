"""A mixture served as one dataset: clients ask for it by name (`PackStream(dataset="sft-mix")`), the server
plans each epoch over the union of its datasets (`packfeed.server.plan.mixture`) and every pack member is
read from its own dataset's shards; packs say which dataset each sample came from (`sample_sources`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mixture import Mixture, MixtureLoads, make_mixture_plan
from packfeed.server.plan.planner import resolve_caps
from packfeed.server.plan.resume import resume_plan
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.serve.jobs import Dataset
from packfeed.v1.options import PixelMode, PlanConfig


class MixtureDataset(Dataset):
    """Quacks like `Dataset` for jobs and the service; its parts are the mixture's datasets."""

    def __init__(self, name: str, mixture: MixtureLoads, parts: list[Dataset]):
        self.name, self.mixture, self._parts = name, mixture, parts
        self.conventions = parts[0].conventions  # the mixture checked that they agree

    @classmethod
    def open(cls, name: str, path: str | Path, pixels: PixelMode = PixelMode.EXACT) -> MixtureDataset:
        """Each dataset opened as the workers will name it (`MIXTURE/DATASET`, read with the tokenizer its index
        records); the mixture planned on the loads they read."""
        from packfeed.server.serve.config import dataset_source

        mixture = Mixture.load(path)
        parts = []
        for entry in mixture.datasets:
            part = Dataset.open(f"{name}/{entry.name}", dataset_source(entry.index, pixels=pixels))
            part.label = entry.name
            parts.append(part)
        return cls(name, MixtureLoads(mixture, [(part.loads, part.info) for part in parts]), parts)

    @property
    def fingerprint(self) -> str:
        return self.mixture.fingerprint

    @property
    def parts(self) -> list[Dataset]:
        return self._parts

    def caps(self, config: PlanConfig) -> Caps | None:
        # a windowed plan searches its caps on its first window
        return None if config.strategy.padded or config.window else resolve_caps(self.mixture.once().loads, config)

    def plan(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
             loads=None) -> Plan | WindowedPlan:  # loads: a dataset's, not a mixture's (unused here)
        if config.window:
            return self.mixture.windowed(config, seed, epoch, caps)
        return make_mixture_plan(self.mixture, config, seed, epoch, caps)

    def resume(self, resume, config: PlanConfig, seed: int, caps: Caps | None) -> Plan:
        """The old job's epoch rows (the same repeats and subset) that its first steps left, planned with
        `config`; rows keep their positions, so packs name the same datasets and samples."""
        old = self.old_plan(resume, config, seed, self.caps(resume.plan))
        plan = resume_plan(old.rows.loads, old, resume.step, config, seed, resume.epoch, self.fingerprint, caps)
        plan.rows = old.rows
        return plan

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return plan.rows.datasets[ids], plan.rows.sample_ids[ids]
