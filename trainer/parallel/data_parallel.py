"""Data parallelism within a pipeline stage, over the replicas of that stage (the mesh's dp group): DDP
(replicated weights, gradients all-reduced), or FSDP2 (`fully_shard` on every vision block and decoder layer,
then the stage: weights, gradients and AdamW state sharded over the replicas, gathered per block as it runs).
`shard` is the one FSDP2 wrapping, also of a whole model's units (`packfeed.trainer.parallel.whole`);
`all_reduce_gradients` the one hand-made gradient reduction (the encoder in the bubbles or routed, context
parallelism)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.recompute import BLOCK_KINDS


def wrap_data_parallel(module: nn.Module, mesh: Mesh, kind: str = "ddp", kinds: list[str] | None = None,
                       precision: str = "fp32", ignored: set | None = None) -> nn.Module:
    """`module` (a StageModule) wrapped for its dp group; `kinds`: its layers' kinds (FSDP2 shards blocks);
    `ignored`: weights FSDP2 leaves whole (tied across stages: `packfeed.trainer.parallel.tied` averages them)."""
    if mesh.dp == 1:
        return module
    if kind == "fsdp":
        return shard_stage(module, mesh, kinds or [], precision, ignored or set())
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=mesh.dp_group)


def shard_stage(module: nn.Module, mesh: Mesh, kinds: list[str], precision: str, ignored: set) -> nn.Module:
    """A stage's blocks (vision blocks, decoder layers) as FSDP2 units of their own, then the stage."""
    blocks = [layer for layer, kind in zip(module.layers.values(), kinds) if kind in BLOCK_KINDS]
    return shard(module, blocks, mesh, precision, ignored & set(module.parameters()))


def shard(module: nn.Module, units: list[nn.Module], mesh: Mesh, precision: str,
          ignored: set | None = None) -> nn.Module:
    """`module` sharded with FSDP2 over the mesh's DP ranks: each of `units`, then the root (`ignored`: its
    weights left whole). bf16: parameters gathered in bf16, gradients reduced in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    device_mesh = mesh.dp_mesh()
    for unit in units:
        fully_shard(unit, mesh=device_mesh, mp_policy=policy)
    fully_shard(module, mesh=device_mesh, mp_policy=policy, ignored_params=ignored or None)
    return module


GRADIENT_BUCKET = 1 << 24  # elements reduced per collective: a large model never needs a second whole copy


def all_reduce_gradients(parameters: list[nn.Parameter], group, scale: float) -> None:
    """Gradients summed over `group` and scaled (zeros where a parameter got none), in flat collectives of at most
    GRADIENT_BUCKET elements (a parameter larger than that alone)."""
    grads = []
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    bucket, size = [], 0
    for grad in grads + [None]:
        if grad is not None:
            bucket.append(grad)
            size += grad.numel()
        if bucket and (grad is None or size >= GRADIENT_BUCKET):
            _reduce_bucket(bucket, group, scale)
            bucket, size = [], 0


def _reduce_bucket(grads: list[torch.Tensor], group, scale: float) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
