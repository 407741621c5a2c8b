"""Weights a model uses in two layers (HF's `tie_word_embeddings`: the LM head is the input embedding) that a
partition puts on different pipeline ranks. Each rank then holds its own copy; after backward the copies'
gradients are summed over the ranks holding them (Megatron's embedding group), so every copy takes the same
optimizer step from the same value and they stay equal. The gradient norm counts each weight once.

With DDP the replicas have averaged each copy's gradient already, so the sum runs within a replica. FSDP2 leaves
such weights unsharded (`ignored`): the sum then runs over every replica's copies at once, divided by the
replicas, which is the average DDP would have taken."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from packfeed.trainer.parallel.mesh import Mesh


class TiedParameters:
    def __init__(self, layers: nn.ModuleList, layer_rank: list[int], mesh: Mesh, across_replicas: bool = False):
        """`layer_rank[i]`: the pipeline rank running layer i under the partition. Collective: every rank
        creates the same groups in the same order."""
        holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                holders.setdefault(id(p), (p, set()))[1].add(layer_rank[i])
        split = sorted({tuple(sorted(ranks)) for _, ranks in holders.values() if len(ranks) > 1})
        self.scale = 1.0 / mesh.dp if across_replicas else 1.0
        self.local: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        self.not_counted: set[int] = set()  # ids of this rank's copies another rank's norm counts
        for ranks in split:
            replicas = [list(range(mesh.dp))] if across_replicas else [[r] for r in range(mesh.dp)]
            for members in replicas:
                group = mesh.new_group([replica * mesh.pp + r for replica in members for r in ranks])
                if mesh.replica not in members or mesh.stage not in ranks:
                    continue
                for p, holding in holders.values():
                    if tuple(sorted(holding)) == ranks:
                        self.local.append((p, group))
                        if mesh.stage != ranks[0]:
                            self.not_counted.add(id(p))

    def __bool__(self) -> bool:
        return bool(self.local)

    @property
    def parameters(self) -> set[nn.Parameter]:
        return {p for p, _ in self.local}

    def sync_gradients(self) -> None:
        for p, group in self.local:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            if self.scale != 1.0:
                p.grad.mul_(self.scale)

    def counted(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters whose gradients this rank adds to the global norm."""
        return [p for p in parameters if id(p) not in self.not_counted]
