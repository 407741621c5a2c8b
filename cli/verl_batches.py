"""verl's batch balancing done by Packfeed's planner, for both of verl's trainers. Each function reorders a step's
batch in place, as verl's own `_balance_batch` does, so that the equal chunks verl's dispatch hands the
data-parallel ranks carry equal work on Packfeed's cost model (attention squares, and the ViT where the batch
says what its images are) instead of token sums.

- `balance_batch(batch, dp_size)`: a `DataProto`, what verl's legacy `RayPPOTrainer` balances
  (`trainer.use_v1=false`). It reads `batch["attention_mask"]` (each rollout's tokens), `batch["prompts"]` (their
  width is the prompt part of the mask), `non_tensor_batch["uid"]` (the group) and
  `non_tensor_batch["multi_modal_inputs"]` (each rollout's `image_grid_thw`, Qwen-style: ViT patches t x h x w per
  image, attended within the image). With `shared_prefix` (verl's `use_prefix_grouper`) each group stays on one
  rank and its prompt is counted once, as the actor computes it once.
- `balance_kv_batch(batch, dp_size)`: a TransferQueue `KVBatchMeta`, what verl's v1 trainers balance (verl's
  default). The driver holds only each rollout's tags there (`prompt_len`, `seq_len`), not its images: the images
  count as the image tokens in their prompt; the ViT's own work is not seen.

Library calls on the driver: no server, and no verl import here (the batches are read through their own fields).
`python -m packfeed.cli.verl_ppo` runs verl's `main_ppo` with its trainers balancing through these
(docs/training.md "verl's batches balanced by Packfeed").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packfeed.server.plan.rollouts import Partition, Rollouts, partition_rollouts
from packfeed.v1.options import CostModel


def rollouts_of(batch: Any, shared_prefix: bool) -> Rollouts:
    """A DataProto's rollouts: their tokens, prompt tokens, prompts' ViT loads and (with `shared_prefix`) groups."""
    mask = batch.batch["attention_mask"]
    tokens = mask.reshape(mask.shape[0], -1).sum(-1).cpu().numpy()
    width = batch.batch["prompts"].shape[1] if "prompts" in batch.batch.keys() else 0
    prompt = mask[:, :width].sum(-1).cpu().numpy() if width else np.zeros_like(tokens)
    patches, squares = np.zeros(len(tokens)), np.zeros(len(tokens))
    inputs = batch.non_tensor_batch.get("multi_modal_inputs")
    for i, item in enumerate(inputs if inputs is not None else []):
        grid = item.get("image_grid_thw") if isinstance(item, dict) else None
        if grid is not None and len(grid):
            per_image = np.asarray(grid, dtype=np.float64).reshape(-1, 3).prod(axis=1)
            patches[i], squares[i] = per_image.sum(), (per_image ** 2).sum()
    group = None
    if shared_prefix:
        if "uid" not in batch.non_tensor_batch:
            raise ValueError("shared_prefix needs each rollout's group: non_tensor_batch['uid'] (verl sets it)")
        group = np.unique(np.asarray(batch.non_tensor_batch["uid"]).astype(str), return_inverse=True)[1]
    return Rollouts(tokens, prompt, patches, squares, group)


def balance_batch(batch: Any, dp_size: int, *, shared_prefix: bool = False, cost_model: CostModel | None = None,
                  metrics: dict | None = None, logging_prefix: str = "global_seqlen",
                  minibatch_size: int | None = None) -> Any:
    """Reorder `batch` (a verl `DataProto`) in place so that its `dp_size` equal chunks are balanced, and return
    it. `shared_prefix`: the actor computes a group's prompt once (groups whole, their prompt counted once).
    `minibatch_size`: balance each PPO mini-batch of that many rollouts on its own (verl's `keep_minibatch`).
    `metrics`: gets `{logging_prefix}/packfeed_dist` (the busiest rank's cost over the mean, minus 1),
    `/packfeed_max` and `/packfeed_min`, and `/packfeed_groups_whole`."""
    order, partitions = balanced_order(rollouts_of(batch, shared_prefix), dp_size, cost_model, shared_prefix,
                                       minibatch_size)
    import torch  # a DataProto holds torch tensors; reorder takes an index tensor

    batch.reorder(torch.as_tensor(order, dtype=torch.long))
    if metrics is not None:
        metrics.update(_metrics(partitions, logging_prefix))
    return batch


def rollouts_of_tags(tags: list[dict]) -> Rollouts:
    """A v1 batch's rollouts from their TransferQueue tags: `seq_len` tokens, `prompt_len` of them the prompt's."""
    try:
        tokens = np.array([tag["seq_len"] for tag in tags], dtype=np.int64)
        prompt = np.array([tag["prompt_len"] for tag in tags], dtype=np.int64)
    except KeyError as missing:
        raise ValueError(f"a rollout's tags lack {missing}: verl's agent loop tags each rollout with seq_len and "
                         "prompt_len; a custom agent loop must too") from None
    return Rollouts(tokens, prompt, np.zeros(len(tags)), np.zeros(len(tags)))


def balance_kv_batch(batch: Any, dp_size: int, *, cost_model: CostModel | None = None,
                     metrics: dict | None = None, logging_prefix: str = "global_seqlen") -> Any:
    """Reorder `batch` (a TransferQueue `KVBatchMeta`, verl's v1 trainers) in place so that its `dp_size` equal
    chunks are balanced on its tags, and return it; `metrics` as `balance_batch` gives them."""
    order, partitions = balanced_order(rollouts_of_tags(batch.tags), dp_size, cost_model, False, None)
    batch.reorder(order.tolist())
    if metrics is not None:
        metrics.update(_metrics(partitions, logging_prefix))
    return batch


def balanced_order(rollouts: Rollouts, dp_size: int, cost_model: CostModel | None, shared_prefix: bool,
                   minibatch_size: int | None) -> tuple[np.ndarray, list[Partition]]:
    """The order that hands rank r its balanced share as the r-th equal chunk (of each mini-batch, in order)."""
    size = minibatch_size or len(rollouts)
    if len(rollouts) % size:
        raise ValueError(f"{len(rollouts)} rollouts are not whole mini-batches of {size}")
    starts = range(0, len(rollouts), size)
    partitions = [partition_rollouts(_slice(rollouts, slice(start, start + size)), dp_size, cost_model,
                                     shared_prefix) for start in starts]
    order = [start + part.ranks[rank] for rank in range(dp_size) for start, part in zip(starts, partitions)]
    return np.concatenate(order).astype(np.int64), partitions


def _slice(rollouts: Rollouts, part: slice) -> Rollouts:
    group = None if rollouts.group is None else rollouts.group[part]
    return Rollouts(rollouts.tokens[part], rollouts.prompt[part], rollouts.vit_patches[part],
                    rollouts.vit_attn_sq[part], group)


def _metrics(partitions: list[Partition], prefix: str) -> dict[str, float]:
    costs = np.sum([p.rank_costs for p in partitions], axis=0)
    mean = costs.mean()
    return {f"{prefix}/packfeed_dist": float(costs.max() / mean - 1) if mean > 0 else 0.0,
            f"{prefix}/packfeed_max": float(costs.max()), f"{prefix}/packfeed_min": float(costs.min()),
            f"{prefix}/packfeed_groups_whole": float(all(p.groups_whole for p in partitions))}
