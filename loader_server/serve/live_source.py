"""A live job's source: `LiveDataset`, what a `Job` asks of its source (its plans are the live steps, its work names
spooled samples, read in a worker through `live_reads.LiveReads`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixel_modes import PIXEL_PATHS
from packfeed.server.live.samples import MAX_SAMPLE_TOKENS, SampleRules
from packfeed.server.live.step_plan import prefix_group
from packfeed.server.live.steps import LiveSteps
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.live_reads import LiveReads, prompt_in
from packfeed.server.serve.step_work import RankStepWork
from packfeed.v1.layout import Seat
from packfeed.v1.options import Oversize, PlanConfig


class LivePlan:
    """The face a Job's epoch plan shows for a live job (its one epoch): steps formed so far, and more to come
    until the job ends."""

    packs_known = False  # steps form as samples arrive
    draws = None  # no mixture weights
    caps = None  # steps are formed as samples arrive: no caps are searched for them

    def __init__(self, steps: LiveSteps, config: PlanConfig, seed: int):
        self.steps, self.config, self.seed, self.epoch = steps, config, seed, 0

    def has_step(self, step: int) -> bool:
        return step >= 0 and self.steps.has_step(step)

    def is_last_step(self, step: int) -> bool:
        return self.steps.is_last(step)

    @property
    def steps_known(self) -> int:
        """The job's length: its `steps` when its plan gives them, the steps formed once it ended, else 0."""
        return self.config.steps or (self.steps.formed if self.steps.ended else 0)

    @property
    def steps_estimate(self) -> int:
        return self.steps.formed

    def fingerprint(self) -> str:
        return self.steps.fingerprint

    def close(self) -> None:
        pass


class LiveDataset:
    """A live job's source (`JobSource`): the dataset whose prompts its samples reference (conventions, image
    policy, shards) and the job's live steps, which its producers feed."""

    def __init__(self, prompts, steps: LiveSteps):
        self.prompts, self.steps = prompts, steps
        self.name = prompts.name
        self._keys: dict[str, int] | None = None
        # the prompts are numbered over the dataset's indexes in order (one, or a mixture's)
        self.offsets = tuple(int(n) for n in np.cumsum([0] + [p.rows.table.num_rows for p in prompts.parts[:-1]]))

    @property
    def fingerprint(self) -> str:
        return self.prompts.fingerprint

    @property
    def live_steps(self) -> LiveSteps:
        return self.steps

    @property
    def conventions(self):
        return self.prompts.conventions

    @property
    def pixels(self):
        return self.prompts.pixels

    def ledger(self, ranks: int) -> None:
        return None  # a live job's samples come from producers, not from mixture weights

    def caps(self, config: PlanConfig, loads=None) -> None:
        return None  # each step's, from its settings or its own samples

    def job_plan(self, config: PlanConfig, seed: int, epoch: int, resume, caps, loads=None, ledger=None) -> LivePlan:
        return LivePlan(self.steps, config, seed)

    def planned_loads(self, plan):
        return None

    def rules(self, config: PlanConfig, decode_budget: int = 0) -> SampleRules:
        """What the job's samples must satisfy. Under the `skip` oversize policy a sample over the caps (with
        context parallelism: over what its rank's C GPUs hold) is refused at its put, never accepted and then
        left out; under `alone` and `truncate` it is taken and planned as that policy says. `decode_budget`: what
        a worker may take to decode one image (an image needing more is refused at its put)."""
        conventions = self.conventions
        tokens, vision = MAX_SAMPLE_TOKENS, 0
        if config.oversize is Oversize.SKIP and config.token_cap is not None:
            per_gpu = config.max_tokens_per_gpu or config.token_cap
            tokens = min(MAX_SAMPLE_TOKENS, per_gpu * config.context_parallel if config.context_parallel > 1
                         else config.token_cap)
            vision = config.vision_cap * config.context_parallel
        return SampleRules(conventions.vocab_size, conventions.image_context_id,
                           policy_from_dict(self.prompts.parts[0].info.image_policy), self.prompt_images, tokens,
                           vision, decode_budget, PIXEL_PATHS[self.pixels].decode_bytes_per_pixel,
                           config.prefix_sharing_refusal() if config.shares_prefixes(True) else "")
        # (a mixture's indexes agree on their conventions)

    def prompt_images(self, key: str) -> tuple[int, list[tuple[int, int]]] | None:
        """An indexed prompt's number (`LiveReads.prompt_of`) and image sizes (None: no such sample, a key in two of
        a mixture's datasets, or a sample holding videos)."""
        if self._keys is None:  # once per job: a dict of the prompts' keys
            keys: dict[str, int] = {}
            for offset, part in zip(self.offsets, self.prompts.parts):
                for number, name in enumerate(part.rows.table.column("key").to_pylist()):
                    keys[name] = -1 if name in keys else offset + number  # -1: which one is meant is unknown
            self._keys = keys
        prompt_id = self._keys.get(key, -1)
        if prompt_id < 0:
            return None
        part, sample_id = prompt_in(self.offsets, prompt_id)
        row = self.prompts.parts[part].rows.row(sample_id)
        if row["n_videos"] or row["frames_fps"] is not None or not row["valid"]:
            return None
        return prompt_id, list(zip(row["image_widths"], row["image_heights"]))

    def work(self, plan: LivePlan, step: int, seat: Seat, decode_budget: int = 0) -> RankStepWork:
        """What a worker needs to prepare one rank's packs of a live step (`JobSource.work`)."""
        rank = seat.rank
        try:
            step_plan = self.steps.plan(step)
        except KeyError as error:
            raise JobError("OUT_OF_RANGE", str(error.args[0])) from None
        except ValueError as error:
            raise JobError("FAILED_PRECONDITION", f"live step {step} cannot be planned: {error}") from None
        if step_plan is None:  # the job's empty last step
            packs = [(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32))] * plan.config.microbatches
            return self._work(step, seat, decode_budget, packs, {}, 0, True)
        packs, positions, spans = [], [], []
        for microbatch in range(step_plan.config.microbatches):
            ids, limits = step_plan.pack_with_truncation(0, rank, microbatch)
            ids = np.asarray(ids, dtype=np.int64)
            packs.append((ids, np.asarray(limits, dtype=np.int64), np.zeros(len(ids), np.int32)))
            positions.extend(ids.tolist())
            spans.append(step_plan.pack_cp(0, rank, microbatch))
        # where a worker reads each row, and (where the step's plan shares prefixes) what it shares its prefix with
        sharing, rows = step_plan.groups is not None, {}
        for position, row in zip(positions, self.steps.member_rows(step, positions)):
            prefix_of = ("\0".join(prefix_group(row)), row.prefix) if sharing and row.prefix_key else None
            fork_of = (row.parent, row.fork_tokens) if sharing and row.parent else None
            rows[position] = replace(row, tar=self.steps.spool.tar_path(row), prefix_of=prefix_of, fork_of=fork_of)
        step_loss = sum(row.loss_tokens for row in self.steps.member_rows(step, step_plan.step_members(0)))
        return self._work(step, seat, decode_budget, packs, rows, step_loss, plan.is_last_step(step), spans)

    def _work(self, step, seat, decode_budget, packs, rows, step_loss, last, spans=None) -> RankStepWork:
        cp = self.steps.config.context_parallel
        if cp > 1 and spans is None:  # the empty last step: every lane an empty share
            spans = [(np.ones(0, np.int64), np.zeros(0, np.int64))] * len(packs)
        parts = self.prompts.parts  # every index a prompt may be read from; a step's members are all live
        reads = LiveReads(rows, self.conventions.image_context_id, self.steps.tensor_names or (), self.offsets,
                          tuple(p.name for p in parts), self.steps.value_names or ())
        return RankStepWork(reads, 0, step, seat, self.steps.config.layout, packs, step_loss, last, self.steps.seed,
                            decode_budget=decode_budget, cp_spans=spans if cp > 1 else None)

    def estimate_bytes(self, work: RankStepWork) -> int:
        rows = work.reads.rows.values()
        return int(sum(row.pixel_bytes + row.tokens * (16 + 4 * len(row.tensors)) + 256 for row in rows)
                   + 1024 * len(work.packs))

    def working_bytes(self, work: RankStepWork) -> int:
        largest = max((w * h for row in work.reads.rows.values() for w, h in row.sizes), default=0)
        need = largest * PIXEL_PATHS[self.pixels].decode_bytes_per_pixel
        return min(need, work.decode_budget) if work.decode_budget else need


