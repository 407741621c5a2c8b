"""The padded baselines (strategies `random` and `length-group`): fixed-size batches of samples, each padded to
its longest, in random or LLaVA's length-grouped order; with `collective_safe`, in whole columns of one class
(`packfeed.server.plan.collective`) where the data allows."""

from __future__ import annotations

import numpy as np

from packfeed.server.plan.balance import lpt_assign
from packfeed.server.plan.collective import aligned_steps, class_layout, collective_safe_layout, pack_classes, sample_towers
from packfeed.v1.options import PlanConfig, Strategy


def padded_batches(loads, valid_ids, config: PlanConfig, rng):
    """Baselines: fixed-size batches padded to their longest sample (random, or LLaVA length-grouped)."""
    batch = max(1, int(round(config.samples_per_pack)))
    order = valid_ids[rng.permutation(len(valid_ids))]
    if config.strategy is Strategy.LENGTH_GROUP:
        order = _length_grouped(order, loads.tokens, config.slots, batch)
    n_packs = -(-len(order) // batch)
    offsets = np.minimum(np.arange(n_packs + 1) * batch, len(order))
    n_slots = -(-n_packs // config.slots) * config.slots
    sequence = np.full(n_slots, -1, dtype=np.int64)
    sequence[:n_packs] = np.arange(n_packs)
    if collective_safe_layout(config):
        sequence = _aligned_batches(order, offsets, loads, config)
    return sequence, order, offsets


def _aligned_batches(order, offsets, loads, config: PlanConfig) -> np.ndarray:
    """Collective-safe padded baselines: the batches in their (random or length-grouped) order, in whole columns
    of one class where the data allows."""
    dp, m, n = config.dp, config.microbatches, len(offsets) - 1
    pack_class = pack_classes(order, offsets, sample_towers(loads))
    full, rest = aligned_steps(np.arange(n), pack_class, np.zeros(n), dp, m)
    if not len(rest):
        return full.reshape(-1)
    last = np.full(config.slots, -1, dtype=np.int64)
    last[:len(rest)] = rest
    return np.concatenate([full.reshape(-1), class_layout(last, pack_class, dp, m)])


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
