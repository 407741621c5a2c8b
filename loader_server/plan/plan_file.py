"""A planned epoch: `Plan` holds which samples go in which pack of which rank and microbatch of every step,
and reads and writes `plan.parquet` (one row per sample; an empty pack is one row with sample_id -1).

`packfeed.server.plan.planner.make_plan` makes a Plan; the server asks it for each rank's packs, the report
and `packfeed plan` for its summary, and every server of a job compares its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq

from packfeed.media.jit import kernel, prange
from packfeed.server import __version__
from packfeed.server.plan.collective import (alignment_summary, sample_towers, tower_names, unaligned_lanes,
                                             unaligned_towers)
from packfeed.server.plan.plan_checks import checked_cp, checked_packs
from packfeed.server.plan.context_parallel import cp_summary
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.groups import group_summary, grouped, prefix_savings
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.metrics import dist_ratio, pad_ratio
from packfeed.server.plan.phases import phase_summary
from packfeed.v1.options import PlanConfig, Strategy

PLAN_METADATA_KEY = b"packfeed.plan"


@dataclass
class Plan:
    """Packs in step-major order: pack p is (step, rank, microbatch) = (p // (D*M), p // M % D, p % M)."""

    config: PlanConfig
    seed: int
    epoch: int
    caps: Caps | None
    offsets: np.ndarray  # n_packs + 1
    members: np.ndarray  # sample ids
    truncate_to: np.ndarray  # per member: token length to cut the sample to, 0 = keep whole
    oversize: np.ndarray  # sample ids the oversize policy handled
    index_fingerprint: str
    seconds: float = 0.0
    pack_vision: np.ndarray | None = None  # per pack, kept from planning so summaries need no gathers
    pack_tokens: np.ndarray | None = None
    rows: Any = field(default=None, repr=False, compare=False)  # MixtureRows: sample ids are rows of a mixture
    encoder_rank: np.ndarray | None = None  # isf+phases: per member, the rank encoding its vision units
    # isf+phases: per further encoder (`packfeed index --encoder`), the rank encoding each member's share of it
    further_encoder_ranks: dict[str, np.ndarray] = field(default_factory=dict)
    phases: Any = field(default=None, repr=False, compare=False)  # isf+phases: its PhasePlan (metrics)
    # context_parallel > 1: per member, its pack's CP degree d and cp_group g (it runs on GPUs [g*d, (g+1)*d) of
    # its rank's CP group; a slot's packs are in the order of their first lane, g*d)
    cp_degree: np.ndarray | None = None
    cp_group: np.ndarray | None = None
    # groups sharing a prefix (`packfeed.server.plan.groups`): per member, its group (-1: none); None: no groups
    groups: np.ndarray | None = None
    window_starts: np.ndarray | None = None  # a windowed epoch written whole: the first step of each window
    _fingerprint: str | None = field(default=None, repr=False, compare=False)
    # what a job asks of any epoch plan (a WindowedPlan's and a live job's answer otherwise): every pack is known,
    # the weights do not move (a moving mixture's draws: none), and closing it stops nothing
    packs_known = True
    draws = None

    def close(self) -> None:
        pass

    @property
    def n_packs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_steps(self) -> int:
        return self.n_packs // self.config.slots

    @property
    def padded(self) -> bool:
        return self.config.strategy.padded

    # What serving asks of any plan, whole-epoch or windowed (`packfeed.server.plan.windows.WindowedPlan`).

    def has_step(self, step: int) -> bool:
        return 0 <= step < self.n_steps

    def is_last_step(self, step: int) -> bool:
        return step == self.n_steps - 1

    @property
    def steps_known(self) -> int:
        """Steps of the epoch (0 while unknown: a windowed plan before its last window)."""
        return self.n_steps

    @property
    def steps_estimate(self) -> int:
        """Steps of the epoch (a windowed plan's extrapolated while some windows are not planned)."""
        return self.n_steps

    def pack_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def pack(self, step: int, rank: int, microbatch: int) -> np.ndarray:
        return self.pack_with_truncation(step, rank, microbatch)[0]

    def pack_with_truncation(self, step: int, rank: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, token limits: 0 = whole) of one pack."""
        p = (step * self.config.dp + rank) * self.config.microbatches + microbatch
        span = slice(self.offsets[p], self.offsets[p + 1])
        return self.members[span], self.truncate_to[span]

    def pack_encoders(self, step: int, rank: int, microbatch: int) -> np.ndarray:
        """The rank encoding each member of one pack (`rank` itself for every strategy but isf+phases)."""
        p = (step * self.config.dp + rank) * self.config.microbatches + microbatch
        if self.encoder_rank is None:
            return np.full(self.offsets[p + 1] - self.offsets[p], rank, dtype=np.int64)
        return np.asarray(self.encoder_rank[self.offsets[p]:self.offsets[p + 1]], dtype=np.int64)

    def pack_cp(self, step: int, rank: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
        """(CP degree, cp_group) of each member of one slot: 1 and 0 without context parallelism."""
        p = (step * self.config.dp + rank) * self.config.microbatches + microbatch
        span = slice(self.offsets[p], self.offsets[p + 1])
        if self.cp_degree is None:
            size = span.stop - span.start
            return np.ones(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
        return np.asarray(self.cp_degree[span], dtype=np.int64), np.asarray(self.cp_group[span], dtype=np.int64)

    def step_members(self, step: int) -> np.ndarray:
        """Every sample of one global step (all ranks and microbatches)."""
        first = step * self.config.slots
        return self.members[self.offsets[first]:self.offsets[first + self.config.slots]]

    def pack_loads(self, loads: SampleLoads) -> tuple[np.ndarray, np.ndarray]:
        """(vision, LLM) load of every pack; LLM load counts padding for padded strategies."""
        if self.pack_vision is not None and not self.padded:
            return self.pack_vision, self.pack_tokens
        tokens = _effective_tokens(loads.tokens[self.members], self.truncate_to)
        vision = segment_sum(loads.vision[self.members], self.offsets)
        if self.padded:
            llm = _segment_max(tokens, self.offsets) * self.pack_sizes()
        else:
            llm = segment_sum(tokens, self.offsets)
        if self.groups is not None:  # every prefix counted once in its pack
            saved = prefix_savings(self.members, self.offsets, loads)
            vision, llm = vision - saved["vision"], llm - saved["tokens"]
        return vision, llm

    def dists(self, loads: SampleLoads) -> tuple[float, float]:
        """(ViT Dist, LLM Dist) of the packs' loads summed per rank and step (the LLM's counting padding)."""
        vision, llm = self.pack_loads(loads)
        shape = (self.n_steps, self.config.dp, self.config.microbatches)
        return dist_ratio(vision.reshape(shape).sum(axis=2)), dist_ratio(llm.reshape(shape).sum(axis=2))

    def summary(self, loads: SampleLoads) -> dict[str, Any]:
        sizes = self.pack_sizes()
        vit_dist, llm_dist = self.dists(loads)
        pad = 0.0
        if self.padded:
            tokens = _effective_tokens(loads.tokens[self.members], self.truncate_to)
            pad = pad_ratio(sizes, _segment_max(tokens, self.offsets), segment_sum(tokens, self.offsets))
        non_empty = int((sizes > 0).sum())
        return {
            "strategy": self.config.strategy.value,
            "samples": int(len(self.members)),
            "valid_samples": int(loads.valid.sum()),
            "invalid_samples": int((~loads.valid).sum()),
            "packs": non_empty,
            "empty_packs": int(len(sizes) - non_empty),
            "steps": self.n_steps,
            "samples_per_pack": round(len(self.members) / max(1, non_empty), 4),
            "pad_ratio": round(pad, 6),
            "vit_dist": round(vit_dist, 6),
            "llm_dist": round(llm_dist, 6),
            "oversize": {"policy": self.config.oversize.value, "count": int(len(self.oversize)),
                         "sample_ids": self.oversize[:20].tolist()},
            "caps": asdict(self.caps) if self.caps else None,
            "planning_seconds": round(self.seconds, 4),
            "collective_safe": self.alignment(loads),
            **({"phases": phase_summary(self.phases, self.config)} if self.phases is not None else {}),
            **({"context_parallel": cp_summary(self, loads)} if self.cp_degree is not None else {}),
            **({"groups": group_summary(prefix_savings(self.members, self.offsets, loads), self.groups is not None)}
               if grouped(loads) else {}),
        }

    def alignment(self, loads: SampleLoads) -> dict[str, Any]:
        """Microbatch indices calling a tower on some DP ranks only (`packfeed.server.plan.collective`): none
        where the data allows, when the plan is collective-safe."""
        members, member_class = np.arange(len(self.members)), sample_towers(loads, self.members)
        if self.cp_degree is not None:  # every GPU of a microbatch index, not only every rank
            unaligned = unaligned_lanes(self.offsets, member_class.astype(np.int64), self.cp_degree, self.cp_group,
                                        self.config.dp, self.config.microbatches, self.config.context_parallel)
        else:
            unaligned = unaligned_towers(self.offsets, members, member_class, self.config.dp,
                                         self.config.microbatches)
        return alignment_summary(unaligned, tower_names(loads), self.config)

    def fingerprint(self) -> str:
        """Digest of config, seed, epoch, index and every pack; computed once. Arrays are hashed as int64 in
        bounded chunks, so the digest does not depend on the dtype they are held in."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            digest.update(json.dumps({"config": self.config.to_dict(), "seed": self.seed, "epoch": self.epoch,
                                      "index": self.index_fingerprint}, sort_keys=True).encode())
            arrays = (self.offsets, self.members, self.truncate_to) + \
                ((self.groups,) if self.groups is not None else ()) + \
                ((self.encoder_rank,) if self.encoder_rank is not None else ()) + \
                tuple(self.further_encoder_ranks[name] for name in sorted(self.further_encoder_ranks)) + \
                ((self.cp_degree, self.cp_group) if self.cp_degree is not None else ())
            for array in arrays:
                for start in range(0, len(array), 1 << 22):
                    digest.update(np.ascontiguousarray(array[start:start + (1 << 22)], dtype=np.int64).tobytes())
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    def _table(self, first: int, stop: int) -> pa.Table:
        """Rows of packs [first, stop): one per sample; an empty pack is one row with sample_id -1 and
        empty = true."""
        step, rank, microbatch, position, sample_id, empty, truncate_to = _plan_rows(
            self.offsets, self.members, self.truncate_to, first, stop, self.config.dp, self.config.microbatches)
        encoder_rank = rank.copy()  # every strategy but isf+phases encodes a sample where its pack trains
        if self.encoder_rank is not None:
            encoder_rank[~empty] = self.encoder_rank[self.offsets[first]:self.offsets[stop]]
        columns = {
            "epoch": pa.array(np.full(len(step), self.epoch, dtype=np.int32)),
            "step": pa.array(step), "rank": pa.array(rank), "microbatch": pa.array(microbatch),
            "position": pa.array(position), "sample_id": pa.array(sample_id), "empty": pa.array(empty),
            "truncate_to": pa.array(truncate_to), "encoder_rank": pa.array(encoder_rank),
        }
        for name, ranks in sorted(self.further_encoder_ranks.items()):  # encoder_rank_audio, ...
            further = rank.copy()
            further[~empty] = ranks[self.offsets[first]:self.offsets[stop]]
            columns[f"encoder_rank_{name}"] = pa.array(further)
        cp, cp_group = np.ones(len(step), dtype=np.int32), np.zeros(len(step), dtype=np.int32)
        if self.cp_degree is not None:
            cp[~empty] = self.cp_degree[self.offsets[first]:self.offsets[stop]]
            cp_group[~empty] = self.cp_group[self.offsets[first]:self.offsets[stop]]
        columns["cp"], columns["cp_group"] = pa.array(cp), pa.array(cp_group)
        if self.groups is not None:  # each sample's group (-1: none, or an empty pack)
            group = np.full(len(step), -1, dtype=np.int64)
            group[~empty] = self.groups[self.offsets[first]:self.offsets[stop]]
            columns["group"] = pa.array(group)
        if self.window_starts is not None:  # each row's window, so "once per window" reads off the file
            columns["window"] = pa.array((np.searchsorted(self.window_starts, step, side="right") - 1).astype(np.int32))
        if self.rows is not None:  # a mixture: each row's dataset, and its sample id in that dataset's index
            real = np.where(empty, 0, sample_id)
            columns["dataset"] = pa.DictionaryArray.from_arrays(
                pa.array(self.rows.datasets[real], mask=empty, type=pa.int32()), pa.array(self.rows.names))
            columns["sample_id"] = pa.array(np.where(empty, -1, self.rows.sample_ids[real]))
        return pa.table(columns)

    def write(self, path: str | Path, rows_per_chunk: int = 1 << 22) -> None:
        """Write plan.parquet in chunks of about `rows_per_chunk` rows, so memory stays bounded."""
        meta = {"config": self.config.to_dict(), "seed": self.seed, "epoch": self.epoch,
                "caps": asdict(self.caps) if self.caps else None, "index_fingerprint": self.index_fingerprint,
                "plan_fingerprint": self.fingerprint(), "oversize": self.oversize.tolist(),
                "packfeed_version": __version__, "mixture": self.rows.names if self.rows is not None else None,
                "window_first_steps": self.window_starts.tolist() if self.window_starts is not None else None}
        rows_before = np.cumsum(np.maximum(self.pack_sizes(), 1))
        cuts = np.searchsorted(rows_before, np.arange(rows_per_chunk, rows_before[-1] if len(rows_before) else 0,
                                                      rows_per_chunk), side="right")
        bounds = [0, *sorted(set(cuts.tolist()) - {0, self.n_packs}), self.n_packs]
        first = self._table(bounds[0], bounds[1])
        schema = first.schema.with_metadata({PLAN_METADATA_KEY: json.dumps(meta, sort_keys=True)})
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Dictionary encoding buys nothing on these integer columns and costs 40% of the write time; delta
        # encoding (standard Parquet) makes the near-monotone ones nearly free and saves another quarter.
        # Statistics only where a reader filters (steps): the others cost a fifth of the encoding time.
        # Build the next chunk's rows (compiled, GIL released) while Arrow encodes the current one.
        delta = {name: "DELTA_BINARY_PACKED" for name in ("epoch", "step", "rank", "microbatch", "position",
                                                          "sample_id", "truncate_to", "encoder_rank", "cp", "cp_group",
                                                          "group", "window")}
        with pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=["dataset"], column_encoding=delta,
                              write_statistics=["step"]) as writer, \
                ThreadPoolExecutor(max_workers=1) as builder:
            chunks = list(zip(bounds[1:-1], bounds[2:]))
            pending = builder.submit(self._table, *chunks[0]) if chunks else None
            writer.write_table(first.cast(schema))
            for k in range(len(chunks)):
                table = pending.result()
                pending = builder.submit(self._table, *chunks[k + 1]) if k + 1 < len(chunks) else None
                writer.write_table(table.cast(schema))


def read_plan(path: str | Path) -> Plan:
    """A plan file, checked: its rows must be a plan (each sample once, every pack inside the config's ranks and
    microbatches, in order), or it is refused naming the file and the first row that is not."""
    table = pq.read_table(path, memory_map=True)
    if PLAN_METADATA_KEY not in (table.schema.metadata or {}):
        raise ValueError(f"{path}: not a plan file (no plan settings in its metadata); write it with packfeed plan --out")
    meta = json.loads(table.schema.metadata[PLAN_METADATA_KEY])
    if meta.get("mixture"):
        raise ValueError(f"{path} is the plan of a mixture: its rows name a dataset and a sample id within it; "
                         "read them as a table (e.g. pyarrow.parquet.read_table)")
    config = PlanConfig.from_dict(meta["config"])
    step, rank, microbatch = (table.column(name).to_numpy().astype(np.int64) for name in ("step", "rank", "microbatch"))
    empty = table.column("empty").to_numpy(zero_copy_only=False)
    pack = checked_packs(path, config, step, rank, microbatch, table.column("sample_id").to_numpy()[~empty])
    n_packs = int(pack.max()) + 1 if len(pack) else 0
    offsets = np.zeros(n_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack[~empty], minlength=n_packs), out=offsets[1:])
    extra: dict = dict(zip(("cp_degree", "cp_group"), checked_cp(path, config, table, empty)))
    if "group" in table.column_names:
        extra["groups"] = table.column("group").to_numpy()[~empty].astype(np.int64)
    if (config.strategy is Strategy.ISF_PHASES or config.disaggregated) and "encoder_rank" in table.column_names:
        extra["encoder_rank"] = table.column("encoder_rank").to_numpy()[~empty]
        extra["further_encoder_ranks"] = {name.removeprefix("encoder_rank_"): table.column(name).to_numpy()[~empty]
                                          for name in table.column_names if name.startswith("encoder_rank_")}
    return Plan(config, meta["seed"], meta["epoch"], Caps(**meta["caps"]) if meta["caps"] else None, offsets,
                table.column("sample_id").to_numpy()[~empty], table.column("truncate_to").to_numpy()[~empty]
                .astype(np.int64), np.asarray(meta["oversize"], dtype=np.int64), meta["index_fingerprint"], **extra)


@kernel(cache=True, nogil=True, parallel=True)
def _plan_rows(offsets, members, truncate, first, stop, dp, m):
    """plan.parquet columns for packs [first, stop): one row per sample, one row for an empty pack.

    Packs are filled in parallel, each into its own rows, so the result never depends on the thread count.
    """
    row_start = np.zeros(stop - first + 1, dtype=np.int64)
    for p in range(first, stop):
        row_start[p - first + 1] = row_start[p - first] + max(offsets[p + 1] - offsets[p], 1)
    n = row_start[-1]
    step = np.empty(n, dtype=np.int32)
    rank = np.empty(n, dtype=np.int32)
    microbatch = np.empty(n, dtype=np.int32)
    position = np.empty(n, dtype=np.int32)
    sample_id = np.empty(n, dtype=np.int64)
    empty = np.zeros(n, dtype=np.bool_)
    truncate_to = np.zeros(n, dtype=np.int32)
    for q in prange(stop - first):
        p = first + q
        size = offsets[p + 1] - offsets[p]
        r = row_start[q]
        for k in range(max(size, 1)):
            step[r + k] = p // (dp * m)
            rank[r + k] = p // m % dp
            microbatch[r + k] = p % m
            position[r + k] = k
            if size == 0:
                sample_id[r + k] = -1
                empty[r + k] = True
            else:
                sample_id[r + k] = members[offsets[p] + k]
                truncate_to[r + k] = truncate[offsets[p] + k]
    return step, rank, microbatch, position, sample_id, empty, truncate_to


def _effective_tokens(tokens, truncate_to):
    return np.where(truncate_to > 0, np.minimum(tokens, truncate_to), tokens)


def segment_sum(values, offsets):
    """Per pack of `offsets` (empty ones 0): the sum of its members' `values`."""
    out = np.zeros(len(offsets) - 1, dtype=np.float64 if values.dtype.kind == "f" else np.int64)
    sizes = np.diff(offsets)
    nz = sizes > 0
    if nz.any():
        out[nz] = np.add.reduceat(values, offsets[:-1][nz])
    return out


def _segment_max(values, offsets):
    out = np.zeros(len(offsets) - 1, dtype=values.dtype)
    sizes = np.diff(offsets)
    nz = sizes > 0
    if nz.any():
        out[nz] = np.maximum.reduceat(values, offsets[:-1][nz])
    return out
