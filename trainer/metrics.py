"""One line of metrics per training step (OUT/metrics.jsonl, and the log every `log_every` steps)."""

from __future__ import annotations

import collections
import json

import torch
import torch.distributed as dist

from packfeed.trainer.batch import StepShape
from packfeed.trainer.parallel.mesh import Mesh, log
from packfeed.trainer.parallel.runner import StepTally


def write_record(metrics, record: dict, count: int, log_every: int, mesh: Mesh) -> None:
    """Rank 0: append the step's metrics line, and log it every `log_every` steps."""
    if metrics is None:
        return
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    if count % log_every == 0:
        padding = f", padding {record['pad_fraction']:.1%}" if "pad_fraction" in record else ""
        log(mesh, f"epoch {record['epoch']} step {record['step']}: loss {record['loss']:.4f}, "
            f"{record['step_s'] * 1e3:.0f} ms, data wait {record['data_wait_s'] * 1e3:.0f} ms, "
            f"{record['tokens_per_s']:.0f} tokens/s{padding}")


def step_record(mesh: Mesh, shape: StepShape, tally: StepTally, elapsed: float, wait: float,
                peak_bytes: int, grad_norm: float) -> dict:
    """One world all-reduce of what each rank measured (`tally`): the loss (the ranks' shares summed), tokens and
    tiles fed, the slowest step time and data wait, the largest CUDA memory peak (0 on CPU), and each rank's busy
    time inside the step (CPU: process time) for the measured bubble fraction
    = 1 - sum(busy) / (ranks x slowest forward-and-backward time)."""
    sums = torch.tensor([tally.loss, tally.tokens, tally.padded_tokens, tally.tiles, tally.padded_tiles,
                         tally.busy_s], dtype=torch.float64, device=mesh.device)
    maxes = torch.tensor([elapsed, wait, tally.compute_s, peak_bytes], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    loss, tokens, padded, tiles, padded_tiles, busy_sum = sums.tolist()
    step_s, wait_s, compute_max, peak_max = maxes.tolist()
    record = {"epoch": shape.epoch, "step": shape.step, "loss": loss, "step_s": step_s, "data_wait_s": wait_s,
              "tokens": int(tokens), "padded_tokens": int(padded), "tiles": int(tiles),
              "padded_tiles": int(padded_tiles), "tokens_per_s": tokens / step_s if step_s else 0.0,
              "pad_fraction": 1 - tokens / padded if padded else 0.0,
              "bubble_fraction": 1 - busy_sum / (mesh.world * compute_max) if compute_max else 0.0,
              "peak_memory_mib": peak_max / 2**20, "pipeline_s": compute_max, "grad_norm": grad_norm}
    gathered = [None] * dist.get_world_size()  # samples per dataset over every replica (mixtures); CP packs
    dist.all_gather_object(gathered, (tally.samples_by_dataset, tally.packs, tally.rows))
    record["samples_by_dataset"] = dict(sum((collections.Counter(c) for c, _, _ in gathered), collections.Counter()))
    packs = sorted({tuple(pack) for _, rank_packs, _ in gathered for pack in rank_packs})
    if packs:
        record["cp_packs"] = [list(pack) for pack in packs]
    for name in sorted({name for _, _, rows in gathered for name in rows}):
        record[name] = sorted(list(row) for _, _, rows in gathered for row in rows.get(name, ()))
    if tally.microbatches is not None:
        record["microbatches"] = tally.microbatches
    record.update(tally.stats)  # e.g. the encoder apart: its seconds, the all-to-all
    return record
