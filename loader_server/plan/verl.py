"""verl's batch balancing done by Packfeed's planner: `balance_batch(batch, dp_size)` takes a step's `DataProto`
and reorders it in place, as verl's own `RayPPOTrainer._balance_batch` does, so that the equal chunks verl's
dispatch hands the data-parallel ranks carry equal work: the vision and LLM cost of Packfeed's cost model (its
attention squares and ViT included) instead of token sums, each group of responses (`uid`) kept on one rank where
the actor computes its prompt once (verl's `use_prefix_grouper`), the prompt then counted once.

    from packfeed.server.plan.verl import balance_batch

    class PackfeedPPOTrainer(RayPPOTrainer):
        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            balance_batch(batch, self._get_dp_size(self.actor_rollout_wg, "actor"), metrics=metrics,
                          shared_prefix=getattr(self, "use_prefix_grouper", False), logging_prefix=logging_prefix,
                          minibatch_size=self.config.actor_rollout_ref.actor.ppo_mini_batch_size
                          if keep_minibatch else None)

A library call on the driver (no server, no verl import here: the batch is read through DataProto's own fields).
What it reads: `batch["attention_mask"]` (each rollout's tokens), `batch["prompts"]` (their width is the prompt
part of the mask), `non_tensor_batch["uid"]` (the group), and `non_tensor_batch["multi_modal_inputs"]` (each
rollout's `image_grid_thw`, Qwen-style: ViT patches t x h x w per image, attended within the image).
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
    rollouts = rollouts_of(batch, shared_prefix)
    size = minibatch_size or len(rollouts)
    if len(rollouts) % size:
        raise ValueError(f"{len(rollouts)} rollouts are not whole mini-batches of {size}")
    order, partitions = [], []
    for start in range(0, len(rollouts), size):
        part = partition_rollouts(_slice(rollouts, slice(start, start + size)), dp_size, cost_model, shared_prefix)
        partitions.append((start, part))
    for rank in range(dp_size):  # rank r's chunk: its share of every mini-batch, in mini-batch order
        order += [start + part.ranks[rank] for start, part in partitions]
    import torch  # a DataProto holds torch tensors; reorder takes an index tensor

    batch.reorder(torch.as_tensor(np.concatenate(order), dtype=torch.long))
    if metrics is not None:
        metrics.update(_metrics([part for _, part in partitions], logging_prefix))
    return batch


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
