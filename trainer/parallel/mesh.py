"""The (dp, cp, pp) process grid: ranks, their process groups, and the small collectives every room uses.

Global rank = (replica * CP + lane) * P + stage. With the encoder on ranks of its own (E encoder ranks,
parallel.encoder=disaggregated, at cp 1) the E ranks come after the grid's: encoder rank e is global rank
dp * pp + e (its stage counts as 0: it streams like a first stage), an LLM rank's `dp_group` is its stage's
replicas as without them and an encoder rank's the E encoder ranks, and `exchange_group` joins the first stages
and the encoder ranks (every rank at pp 1), the ranks the encoder's outputs travel between. With context
parallelism (cp > 1, at pp 1) the data-parallel
group holds every rank (each GPU's gradients are partial sums of its replica's), and `cp_communicators` holds a
process group for each aligned run of d GPUs of this rank's replica (d = 2, 4, ..., cp), the GPUs a pack at
degree d runs on. Every rank creates every process group in the same order, as torch.distributed requires.
Which layouts combine is `Layout.problems()`'s to say.
"""

from __future__ import annotations

import datetime

import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from packfeed.v1.layout import Layout, Seat


@dataclass
class Mesh:
    """This process's place in the layout's grid and the process groups that go with it."""

    layout: Layout
    rank: int
    device: torch.device
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_communicators: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)  # (degree, cp_group)
    exchange_group: dist.ProcessGroup | None = None  # encoder ranks: the first stages and the encoder ranks
    timeout: datetime.timedelta | None = None  # every group's collectives (parallel.timeout_s; None: torch's)

    _device_mesh: object = None

    def dp_mesh(self):
        """This rank's data-parallel DeviceMesh (FSDP2), from the (dp, pp) grid: made once, collectively."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(self.device.type, (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        return self._device_mesh["dp"]

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def encoder_ranks(self) -> int:
        return self.layout.encoder_ranks

    @property
    def replica(self) -> int:
        return self.rank // (self.pp * self.cp)

    @property
    def lane(self) -> int:
        """This rank's GPU of its replica's CP group (0..cp-1)."""
        return self.rank // self.pp % self.cp

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def is_encoder(self) -> bool:
        """One of the encoder's own ranks (parallel.encoder=disaggregated)."""
        return self.rank >= self.layout.llm_ranks

    @property
    def encoder_rank(self) -> int:
        return self.rank - self.layout.llm_ranks

    @property
    def seat(self) -> Seat:
        """Where this rank reads its packs: its replica's (lane) or its encoder rank's seat; every stage of a
        pipeline reads its first stage's packs."""
        return Seat(self.encoder_rank, encoder=True) if self.is_encoder else Seat(self.replica, lane=self.lane)

    def new_group(self, members: list[int], **options) -> dist.ProcessGroup:
        """A process group with the run's timeout (torch gives groups its own default, not the world's)."""
        return dist.new_group(members, timeout=self.timeout, **options)

    def describe_rank(self, rank: int) -> str:
        """How messages name a global rank: an LLM rank with its replica and stage, or an encoder rank."""
        grid = self.layout.llm_ranks
        if rank >= grid:
            return f"rank {rank} (encoder rank {rank - grid})"
        return f"rank {rank} (replica {rank // (self.pp * self.cp)}, stage {rank % self.pp})"

    @property
    def stage(self) -> int:
        return 0 if self.is_encoder else self.rank % self.pp

    @property
    def first_stage_rank(self) -> int:
        return self.rank - self.stage

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1


def make_mesh(layout: Layout, device: torch.device, timeout: datetime.timedelta | None = None) -> Mesh:
    """Groups for an initialised default process group of the layout's world (every rank creates every group, in
    the same order, as torch.distributed requires)."""
    layout.checked()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, pp, cp, encoder_ranks = layout.dp, layout.pp, layout.cp, layout.encoder_ranks
    if world != layout.world:
        encoders = f" + encoder_ranks {encoder_ranks}" if encoder_ranks else ""
        raise ValueError(f"world size {world} != dp {dp} x cp {cp} x pp {pp}{encoders}: launch {layout.world} "
                         "processes")
    mesh = Mesh(layout, rank, device, timeout=timeout)
    if cp > 1:
        mesh.dp_group = dist.group.WORLD
        for replica in range(dp):
            degree = 2
            while degree <= cp:
                for group in range(cp // degree):
                    members = [replica * cp + group * degree + k for k in range(degree)]
                    made = mesh.new_group(members)
                    if replica == mesh.replica:
                        mesh.cp_communicators[degree, group] = made
                degree *= 2
        return mesh
    for replica in range(dp):
        group = mesh.new_group([replica * pp + s for s in range(pp)])
        if replica == mesh.replica:
            mesh.pp_group = group
    for stage in range(pp):
        group = mesh.new_group([r * pp + stage for r in range(dp)])
        if stage == mesh.stage and not mesh.is_encoder:
            mesh.dp_group = group
    if encoder_ranks:
        encoders = list(range(dp * pp, dp * pp + encoder_ranks))
        made = mesh.new_group(encoders)
        if mesh.is_encoder:
            mesh.dp_group = made
        first_stages = [replica * pp for replica in range(dp)]
        mesh.exchange_group = mesh.new_group(first_stages + encoders) if pp > 1 else dist.group.WORLD
    return mesh


def log(mesh: Mesh | None, message: str, everyone: bool = False) -> None:
    if mesh is None or everyone or mesh.rank == 0:
        print(f"[packfeed train{'' if mesh is None else f' r{mesh.rank}'}] {message}", file=sys.stderr, flush=True)


def broadcast_object(value, mesh: Mesh, src: int = 0):
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_over_world(value: float, mesh: Mesh) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
