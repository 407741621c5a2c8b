"""Data parallelism within a pipeline stage: DDP over the replicas of one stage (the mesh's dp group)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from packfeed.trainer.parallel.mesh import Mesh


def wrap_data_parallel(module: nn.Module, mesh: Mesh) -> nn.Module:
    if mesh.dp == 1:
        return module
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=mesh.dp_group)
