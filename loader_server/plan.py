"""The plan: a pure function of (index, config, seed, epoch) that says which samples every DP rank
trains on in every microbatch of every step.

Guarantees (tested):
- every valid sample appears exactly once per epoch, except samples the `skip` oversize policy drops,
  which are reported;
- with the ISF strategies no pack of two or more samples exceeds a cap; a sample that alone exceeds a
  cap travels alone (`alone`, default), is dropped (`skip`), or has its tokens cut to the cap (`truncate`);
- every rank gets exactly M packs in every step; only the last step may hold lighter packs or empty
  packs (flagged), so no rank waits on a collective that others skip;
- same inputs give a byte-identical plan; nothing depends on process, thread count or hash seeds.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packfeed.server import __version__
from packfeed.server.balance import form_steps, lpt_assign, split_for_last_step
from packfeed.server.caps import default_targets, search_caps
from packfeed.server.costs import CostModel, SampleLoads
from packfeed.server.isf import Caps, IsfPacks, isf
from packfeed.server.metrics import dist_ratio, pad_ratio
from packfeed.server.pipeline_order import inter_reorder_many, stage_fractions, stage_times

STRATEGIES = ("random", "length-group", "isf", "isf+balance")
OVERSIZE_POLICIES = ("alone", "skip", "truncate")
PLAN_METADATA_KEY = b"packfeed.plan"

# Independent random streams per purpose, so changing one stage never shifts another's randomness.
_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES = 1, 2, 3, 4


@dataclass(frozen=True)
class PlanConfig:
    dp: int = 8
    microbatches: int = 1
    pipeline_stages: int = 1
    strategy: str = "isf+balance"
    vision_cap: int | None = None
    token_cap: int | None = None
    vision_target: int | None = None
    token_target: int | None = None
    isf_iterations: int = 10
    samples_per_pack: float = 4.0  # automatic caps aim here; batch size of the random / length-group baselines
    oversize: str = "alone"
    cost_model: CostModel = field(default_factory=CostModel.from_shapes)

    def __post_init__(self):
        problems = []
        if self.dp < 1 or self.microbatches < 1 or self.pipeline_stages < 1:
            problems.append("dp, microbatches and pipeline_stages must be >= 1")
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {', '.join(STRATEGIES)}")
        if self.oversize not in OVERSIZE_POLICIES:
            problems.append(f"oversize must be one of {', '.join(OVERSIZE_POLICIES)}")
        if self.isf_iterations < 1:
            problems.append("isf_iterations must be >= 1")
        if self.samples_per_pack < 1:
            problems.append("samples_per_pack must be >= 1")
        if (self.vision_cap is None) != (self.token_cap is None):
            problems.append("give both --vision-cap and --token-cap, or neither (automatic)")
        if problems:
            raise ValueError("invalid plan config: " + "; ".join(problems))

    @property
    def slots(self) -> int:
        return self.dp * self.microbatches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "PlanConfig":
        raw = dict(raw)
        if isinstance(raw.get("cost_model"), dict):
            raw["cost_model"] = CostModel(**raw["cost_model"])
        return cls(**raw)


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
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

    @property
    def n_packs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_steps(self) -> int:
        return self.n_packs // self.config.slots

    @property
    def padded(self) -> bool:
        return self.config.strategy in ("random", "length-group")

    def pack_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def pack(self, step: int, rank: int, microbatch: int) -> np.ndarray:
        return self.pack_with_truncation(step, rank, microbatch)[0]

    def pack_with_truncation(self, step: int, rank: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, token limits: 0 = whole) of one pack."""
        p = (step * self.config.dp + rank) * self.config.microbatches + microbatch
        span = slice(self.offsets[p], self.offsets[p + 1])
        return self.members[span], self.truncate_to[span]

    def step_members(self, step: int) -> np.ndarray:
        """Every sample of one global step (all ranks and microbatches)."""
        first = step * self.config.slots
        return self.members[self.offsets[first]:self.offsets[first + self.config.slots]]

    def pack_loads(self, loads: SampleLoads) -> tuple[np.ndarray, np.ndarray]:
        """(vision, LLM) load of every pack; LLM load counts padding for padded strategies."""
        if self.pack_vision is not None and not self.padded:
            return self.pack_vision, self.pack_tokens
        tokens = _effective_tokens(loads.tokens[self.members], self.truncate_to)
        vision = _segment_sum(loads.vision[self.members], self.offsets)
        if self.padded:
            llm = _segment_max(tokens, self.offsets) * self.pack_sizes()
        else:
            llm = _segment_sum(tokens, self.offsets)
        return vision, llm

    def summary(self, loads: SampleLoads) -> dict[str, Any]:
        sizes = self.pack_sizes()
        vision, llm = self.pack_loads(loads)
        shape = (self.n_steps, self.config.dp, self.config.microbatches)
        pad = 0.0
        if self.padded:
            tokens = _effective_tokens(loads.tokens[self.members], self.truncate_to)
            pad = pad_ratio(sizes, _segment_max(tokens, self.offsets), _segment_sum(tokens, self.offsets))
        non_empty = int((sizes > 0).sum())
        return {
            "strategy": self.config.strategy,
            "samples": int(len(self.members)),
            "valid_samples": int(loads.valid.sum()),
            "invalid_samples": int((~loads.valid).sum()),
            "packs": non_empty,
            "empty_packs": int(len(sizes) - non_empty),
            "steps": self.n_steps,
            "samples_per_pack": round(len(self.members) / max(1, non_empty), 4),
            "pad_ratio": round(pad, 6),
            "vit_dist": round(dist_ratio(vision.reshape(shape).sum(axis=2)), 6),
            "llm_dist": round(dist_ratio(llm.reshape(shape).sum(axis=2)), 6),
            "oversize": {"policy": self.config.oversize, "count": int(len(self.oversize)),
                         "sample_ids": self.oversize[:20].tolist()},
            "caps": asdict(self.caps) if self.caps else None,
            "planning_seconds": round(self.seconds, 4),
        }

    def fingerprint(self) -> str:
        """Digest of config, seed, epoch, index and every pack; computed once. Arrays are hashed as int64 in
        bounded chunks, so the digest does not depend on the dtype they are held in."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            digest.update(json.dumps({"config": self.config.to_dict(), "seed": self.seed, "epoch": self.epoch,
                                      "index": self.index_fingerprint}, sort_keys=True).encode())
            for array in (self.offsets, self.members, self.truncate_to):
                for start in range(0, len(array), 1 << 22):
                    digest.update(np.ascontiguousarray(array[start:start + (1 << 22)], dtype=np.int64).tobytes())
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    def _table(self, first: int, stop: int) -> pa.Table:
        """Rows of packs [first, stop): one per sample; an empty pack is one row with sample_id -1 and
        empty = true."""
        step, rank, microbatch, position, sample_id, empty, truncate_to = _plan_rows(
            self.offsets, self.members, self.truncate_to, first, stop, self.config.dp, self.config.microbatches)
        return pa.table({
            "epoch": pa.array(np.full(len(step), self.epoch, dtype=np.int32)),
            "step": pa.array(step), "rank": pa.array(rank), "microbatch": pa.array(microbatch),
            "position": pa.array(position), "sample_id": pa.array(sample_id), "empty": pa.array(empty),
            "truncate_to": pa.array(truncate_to),
        })

    def write(self, path: str | Path, rows_per_chunk: int = 1 << 22) -> None:
        """Write plan.parquet in chunks of about `rows_per_chunk` rows, so memory stays bounded."""
        meta = {"config": self.config.to_dict(), "seed": self.seed, "epoch": self.epoch,
                "caps": asdict(self.caps) if self.caps else None, "index_fingerprint": self.index_fingerprint,
                "plan_fingerprint": self.fingerprint(), "oversize": self.oversize.tolist(),
                "packfeed_version": __version__}
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
                                                          "sample_id", "truncate_to")}
        with pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=False, column_encoding=delta,
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
    table = pq.read_table(path, memory_map=True)
    meta = json.loads(table.schema.metadata[PLAN_METADATA_KEY])
    config = PlanConfig.from_dict(meta["config"])
    pack = (table.column("step").to_numpy().astype(np.int64) * config.dp
            + table.column("rank").to_numpy()) * config.microbatches + table.column("microbatch").to_numpy()
    empty = table.column("empty").to_numpy(zero_copy_only=False)
    n_packs = int(pack.max()) + 1 if len(pack) else 0
    offsets = np.zeros(n_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack[~empty], minlength=n_packs), out=offsets[1:])
    return Plan(config, meta["seed"], meta["epoch"], Caps(**meta["caps"]) if meta["caps"] else None, offsets,
                table.column("sample_id").to_numpy()[~empty], table.column("truncate_to").to_numpy()[~empty]
                .astype(np.int64), np.asarray(meta["oversize"], dtype=np.int64), meta["index_fingerprint"])


@numba.njit(cache=True, nogil=True, parallel=True)
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
    for q in numba.prange(stop - first):
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


# ---------------------------------------------------------------------------------------------------------------
# Building a plan


def make_plan(loads: SampleLoads, config: PlanConfig, seed: int, epoch: int, index_fingerprint: str = "",
              caps: Caps | None = None) -> Plan:
    """Plan one epoch. `caps` short-circuits the automatic search (e.g. reuse it across epochs)."""
    started = time.perf_counter()
    seeds = np.random.SeedSequence([seed, epoch])
    streams = {k: np.random.default_rng(s) for k, s in zip(
        (_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES), seeds.spawn(4))}
    oversize = np.empty(0, dtype=np.int64)
    cut = np.empty(0, dtype=np.int64)
    pieces = []

    if config.strategy in ("random", "length-group"):
        caps = None
        sequence, packs_m, packs_o = _padded_batches(loads, np.flatnonzero(loads.valid), config,
                                                     streams[_STREAM_BATCHES])
    else:
        caps = caps or resolve_caps(loads, config)
        packs, oversize, cut, tokens = _isf_packs(loads, caps, config, streams[_STREAM_ISF])
        loads = replace(loads, tokens=tokens)  # the planner sees truncated samples at their cut length
        sequence, packs, pieces = _arrange_packs(loads, packs, config, streams)
        packs_m, packs_o = packs.members, packs.offsets
        real = sequence >= 0
        pack_vision = np.where(real, packs.vision[np.where(real, sequence, 0)], 0)
        pack_tokens = np.where(real, packs.tokens[np.where(real, sequence, 0)], 0)

    offsets, members = _gather(sequence, packs_m, packs_o, *_csr(pieces, packs_m.dtype))
    truncate_to = np.zeros(len(members), dtype=np.int32)
    if len(cut):
        is_cut = np.zeros(len(loads), dtype=bool)
        is_cut[cut] = True
        truncate_to[is_cut[members]] = caps.token_cap
    plan = Plan(config, seed, epoch, caps, offsets, members, truncate_to, oversize, index_fingerprint)
    if caps is not None:
        plan.pack_vision, plan.pack_tokens = pack_vision, pack_tokens
    plan.seconds = time.perf_counter() - started
    return plan


def resolve_caps(loads: SampleLoads, config: PlanConfig) -> Caps:
    """Caps from the config, completed with default targets, or searched from the data."""
    if config.vision_cap is not None:
        vt, tt = default_targets(config.vision_cap, config.token_cap)
        return Caps(config.vision_cap, config.token_cap,
                    config.vision_target if config.vision_target is not None else vt,
                    config.token_target if config.token_target is not None else tt)
    valid = loads.valid
    if not valid.any():
        return Caps(1, 1, 1, 1)  # nothing to pack: the plan is empty whatever the caps
    everything = valid.all()
    caps, _ = search_caps(loads.vision if everything else loads.vision[valid],
                          loads.tokens if everything else loads.tokens[valid], config.dp, config.samples_per_pack,
                          config.isf_iterations)
    if config.vision_target is not None or config.token_target is not None:
        caps = Caps(caps.vision_cap, caps.token_cap,
                    config.vision_target if config.vision_target is not None else caps.vision_target,
                    config.token_target if config.token_target is not None else caps.token_target)
    return caps


def _isf_packs(loads, caps: Caps, config: PlanConfig, rng):
    """ISF packs of the samples that fit, plus the oversize policy. Returns (packs, oversize, cut, tokens):
    `cut` are the samples whose tokens the `truncate` policy cuts to the token cap, `tokens` every sample's
    tokens as planned (cut ones at the cap; the index's own array when nothing is cut)."""
    vision, tokens = loads.vision, loads.tokens
    # int32 ids below 2^31 samples halve the largest arrays of planning.
    valid_ids = _flatnonzero(loads.valid, np.int32 if len(loads) < 2**31 else np.int64)
    vision_over = vision[valid_ids] > caps.vision_cap
    token_over = tokens[valid_ids] > caps.token_cap
    over = vision_over | token_over
    oversize = valid_ids[over].astype(np.int64)
    alone = oversize if config.oversize == "alone" else np.empty(0, dtype=np.int64)
    cut = np.empty(0, dtype=np.int64)
    if config.oversize == "truncate":
        # Text can be cut to the token cap; too many vision units cannot, so those travel alone.
        cut = valid_ids[token_over & ~vision_over].astype(np.int64)
        alone = valid_ids[vision_over].astype(np.int64)
        over = vision_over
        if len(cut):
            tokens = tokens.copy()
            tokens[cut] = caps.token_cap
    fits = valid_ids[~over]
    del valid_ids, vision_over, token_over, over
    packs = isf(fits, vision, tokens, caps, config.isf_iterations, rng)
    if len(alone):
        packs = IsfPacks(np.concatenate([packs.members, alone.astype(packs.members.dtype)]),
                         np.concatenate([packs.offsets, packs.offsets[-1] + np.arange(1, len(alone) + 1)]),
                         np.concatenate([packs.vision, vision[alone]]), np.concatenate([packs.tokens, tokens[alone]]))
    return packs, oversize, cut, tokens


def _arrange_packs(loads, packs: IsfPacks, config: PlanConfig, streams):
    """Order packs into steps x ranks x microbatches. Returns the pack sequence (-1 = empty pack), the packs'
    loads extended by those of the pieces the last step was split into, and the pieces' members (pack
    `len(packs) + k` is piece k: the members array is not copied for a handful of pieces)."""
    slots, dp, m = config.slots, config.dp, config.microbatches
    costs = config.cost_model.sample_costs(loads)
    pack_cv, pack_cl = _pack_costs(packs.members, packs.offsets, costs)
    pack_cost = pack_cv + pack_cl
    members, offsets, pack_v, pack_t = packs.members, packs.offsets, packs.vision, packs.tokens

    if config.strategy == "isf":
        # OmniBal's published behaviour: packs go to steps and ranks in random order.
        shuffled = streams[_STREAM_STEPS].permutation(len(pack_cost))
        n_rest = len(shuffled) % slots
        full, rest = shuffled[:len(shuffled) - n_rest].reshape(-1, slots), shuffled[len(shuffled) - n_rest:]
    else:
        full, rest = form_steps(pack_v, pack_t, pack_cost, slots)
        full = full[streams[_STREAM_STEPS].permutation(len(full))]

    # The last, partial step: split its packs so every rank still gets work where samples allow.
    pieces = []
    if len(rest):
        pieces = split_for_last_step([members[offsets[p]:offsets[p + 1]] for p in rest],
                                     lambda ids: costs[ids].sum(axis=1, dtype=np.float64), slots)
        first_new = len(pack_cost)
        pack_v = np.concatenate([pack_v, [loads.vision[piece].sum() for piece in pieces]])
        pack_t = np.concatenate([pack_t, [loads.tokens[piece].sum() for piece in pieces]])
        pack_cv = np.concatenate([pack_cv, [costs[piece, 0].sum(dtype=np.float64) for piece in pieces]])
        pack_cl = np.concatenate([pack_cl, [costs[piece, 1].sum(dtype=np.float64) for piece in pieces]])
        pack_cost = pack_cv + pack_cl
        last = np.full(slots, -1, dtype=np.int64)
        last[:len(pieces)] = first_new + np.arange(len(pieces))
        full = np.vstack([full, last[None, :]])

    if config.strategy == "isf":
        grid = full.reshape(-1, dp, m)
    else:
        grid = _assign_ranks(full, pack_cost, dp, m)
        # Which rank gets the heaviest pack is arbitrary; rotate it so no rank is systematically heavier.
        grid = _permute_ranks(grid, streams[_STREAM_RANKS].random((len(grid), dp)))
        if config.pipeline_stages > 1 and m > 1:
            grid = _order_for_pipeline(grid, pack_cv, pack_cl, config.pipeline_stages)
    return grid.reshape(-1), IsfPacks(members, offsets, pack_v, pack_t), pieces


@numba.njit(cache=True, nogil=True, parallel=True)
def _assign_ranks(steps, cost, dp, m):
    """LPT per step with M packs per rank; each rank's packs by decreasing cost; -1 (empty) packs last.
    Steps are independent, so they run in parallel."""
    n_steps = steps.shape[0]
    grid = np.full((n_steps, dp, m), -1, dtype=np.int64)
    for st in numba.prange(n_steps):
        packs = steps[st][steps[st] >= 0]
        c = np.empty(len(packs))
        for k in range(len(packs)):
            c[k] = cost[packs[k]]
        bins = lpt_assign(c, dp, m)
        filled = np.zeros(dp, dtype=np.int64)
        for k in np.argsort(-c, kind="mergesort"):
            r = bins[k]
            grid[st, r, filled[r]] = packs[k]
            filled[r] += 1
    return grid


@numba.njit(cache=True, nogil=True, parallel=True)
def _permute_ranks(grid, keys):
    """Each step's ranks in the order of their random keys (a per-step random permutation)."""
    out = np.empty_like(grid)
    for st in numba.prange(grid.shape[0]):
        order = np.argsort(keys[st])
        for r in range(grid.shape[1]):
            out[st, r] = grid[st, order[r]]
    return out


def _order_for_pipeline(grid, pack_cv, pack_cl, stages):
    """MMScale inter-microbatch reordering of every rank's M packs for 1F1B."""
    if grid.size == 0:
        return grid
    real = grid >= 0
    safe = np.where(real, grid, 0)
    cv = np.where(real, pack_cv[safe], 0.0)
    cl = np.where(real, pack_cl[safe], 0.0)
    fv, fl = stage_fractions(float(pack_cv.mean()), float(pack_cl.mean()), stages)
    forward, backward = stage_times(cv.reshape(-1), cl.reshape(-1), fv, fl)
    shape = (grid.shape[0] * grid.shape[1], grid.shape[2], stages)
    order = inter_reorder_many(forward.reshape(shape), backward.reshape(shape))
    flat = grid.reshape(-1, grid.shape[2])
    return np.take_along_axis(flat, order, axis=1).reshape(grid.shape)


def _padded_batches(loads, valid_ids, config: PlanConfig, rng):
    """Baselines: fixed-size batches padded to their longest sample (random, or LLaVA length-grouped)."""
    batch = max(1, int(round(config.samples_per_pack)))
    order = valid_ids[rng.permutation(len(valid_ids))]
    if config.strategy == "length-group":
        order = _length_grouped(order, loads.tokens, config.slots, batch)
    n_packs = -(-len(order) // batch)
    offsets = np.minimum(np.arange(n_packs + 1) * batch, len(order))
    n_slots = -(-n_packs // config.slots) * config.slots
    sequence = np.full(n_slots, -1, dtype=np.int64)
    sequence[:n_packs] = np.arange(n_packs)
    return sequence, order, offsets


def _length_grouped(order, tokens, slots, batch):
    """LLaVA's length grouping: megabatches of slots x batch, split into even chunks of similar length."""
    mega = slots * batch
    out = []
    for start in range(0, len(order), mega):
        chunk = order[start:start + mega]
        per = -(-len(chunk) // slots)
        bins = lpt_assign(tokens[chunk].astype(np.float64), slots, per)
        out.extend(chunk[bins == b] for b in range(slots))
    return np.concatenate(out) if out else order


def _flatnonzero(mask: np.ndarray, dtype) -> np.ndarray:
    """np.flatnonzero straight into `dtype` (no int64 temporary of the whole index)."""
    out = np.empty(int(np.count_nonzero(mask)), dtype=dtype)
    _fill_nonzero(mask, out)
    return out


@numba.njit(cache=True, nogil=True)
def _fill_nonzero(mask, out):
    k = 0
    for i in range(len(mask)):
        if mask[i]:
            out[k] = i
            k += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def _pack_costs(members, offsets, costs):
    """Per pack: (vision cost, LLM cost), summed in float64, packs in parallel (each sums its own members
    in order, so the sums do not depend on the thread count)."""
    n = len(offsets) - 1
    pack_cv = np.zeros(n)
    pack_cl = np.zeros(n)
    for p in numba.prange(n):
        for k in range(offsets[p], offsets[p + 1]):
            pack_cv[p] += costs[members[k], 0]
            pack_cl[p] += costs[members[k], 1]
    return pack_cv, pack_cl


def _effective_tokens(tokens, truncate_to):
    return np.where(truncate_to > 0, np.minimum(tokens, truncate_to), tokens)


def _csr(pieces: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(piece) for piece in pieces], out=offsets[1:])
    members = np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype=dtype)
    return members, offsets


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather(sequence, members, offsets, extra_members, extra_offsets):
    """Re-lay packs out in `sequence` order (-1 = empty pack; p >= len(offsets) - 1 = extra pack
    p - (len(offsets) - 1)); returns (offsets, members)."""
    n_base = len(offsets) - 1
    new_offsets = np.zeros(len(sequence) + 1, dtype=np.int64)
    for q in range(len(sequence)):
        p = sequence[q]
        size = 0
        if p >= n_base:
            size = extra_offsets[p - n_base + 1] - extra_offsets[p - n_base]
        elif p >= 0:
            size = offsets[p + 1] - offsets[p]
        new_offsets[q + 1] = new_offsets[q] + size
    out = np.empty(new_offsets[-1], dtype=members.dtype)
    for q in numba.prange(len(sequence)):
        p = sequence[q]
        if p >= n_base:
            out[new_offsets[q]:new_offsets[q + 1]] = extra_members[extra_offsets[p - n_base]:
                                                                   extra_offsets[p - n_base + 1]]
        elif p >= 0:
            out[new_offsets[q]:new_offsets[q + 1]] = members[offsets[p]:offsets[p + 1]]
    return new_offsets, out


def _segment_sum(values, offsets):
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
