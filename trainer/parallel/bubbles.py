"""Optimus's bubble scheduling, executed (`parallel.encoder=bubbles`): the pipeline stages hold only the LLM's
layers; every pipeline rank holds the whole vision encoder and encodes a balanced share of each microbatch's
tiles in its schedule's idle time.

One step on one rank:
1. The first stage tells its replica how many real tiles each microbatch holds; every rank derives the same
   balanced split (`packfeed.trainer.parallel.schedules.split_tiles`, the simulator's too) and the first stage sends
   each rank the pixels of its shares.
2. The rank runs its 1F1B (or GPipe) order of LLM operations (`packfeed.trainer.parallel.schedules`, the
   simulator's too). Whenever the next operation waits for a message, the rank runs encoder work instead, one
   encoder layer at a time: the forward of its next share (in microbatch order), else the backward of a share
   whose embedding gradients have come back.
3. Deadlines keep the first stage fed (`encoder_deadlines`, the simulator's rule): where the first stage's order
   runs F(j) right after B(i), every rank finishes its share of microbatch j's encoder forward before its own
   B(i) — the first stage cannot reach F(j) before every rank has passed B(i). The first stage encodes its own
   share of j at the latest right before F(j).
4. A share's embeddings go to the first stage, which pads them into the microbatch's vision features (a leaf
   that collects their gradient) and runs the LLM; after its backward of the microbatch it sends each rank the
   gradient of its share, and the rank runs that share's encoder backward.
5. Gradients: the LLM stage's are averaged over its DP group; the encoder's are summed over every rank of every
   replica (each rank's shares) and divided by DP — both what DDP would give, so the loss and every gradient
   equal `parallel.encoder=stages` on the same packs.

Messages are tagged by (kind, microbatch, tensor), so they may be posted in any order: gloo matches tags. On
CUDA they go through host memory on a gloo group of the replica (NCCL matches point-to-point messages by their
posting order, which filler work changes from step to step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from packfeed.trainer.batch import StepShape
from packfeed.trainer.parallel.data_parallel import all_reduce_gradients
from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.schedules import encoder_deadlines, pipeline_order, split_tiles

PIXELS, FEATURES, FEATURE_GRADS, ACTIVATIONS, GRADS = range(1, 6)


def message_tag(kind: int, microbatch: int, index: int = 0) -> int:
    return (kind * 4096 + microbatch) * 64 + index


class Channel:
    """Point-to-point messages between the pipeline ranks of this replica."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.staged = mesh.device.type != "cpu"
        self.group = mesh.pp_group
        if self.staged:  # collective: every rank creates every replica's group, in order
            for replica in range(mesh.dp):
                group = mesh.new_group([replica * mesh.pp + s for s in range(mesh.pp)], backend="gloo")
                if replica == mesh.replica:
                    self.group = group

    def rank_of(self, stage: int) -> int:
        return self.mesh.first_stage_rank + stage

    def send(self, tensor: torch.Tensor, stage: int, tag: int) -> dist.Work:
        payload = tensor.detach().contiguous()
        if self.staged:
            payload = payload.cpu()
        return dist.isend(payload, dst=self.rank_of(stage), group=self.group, tag=tag)

    def recv(self, like: torch.Tensor, stage: int, tag: int) -> Pending:
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu" if self.staged else like.device)
        return Pending(dist.irecv(buffer, src=self.rank_of(stage), group=self.group, tag=tag), buffer,
                       self.mesh.device)


@dataclass
class Pending:
    work: dist.Work
    buffer: torch.Tensor
    device: torch.device

    def ready(self) -> bool:
        return self.work.is_completed()

    def take(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer.to(self.device, non_blocking=True)


@dataclass
class BubbleRunner:
    """Runs one step of this rank's schedule with the encoder in its bubbles (see the module docstring)."""

    mesh: Mesh
    encoder: nn.Module  # a StageModule over the model's encoder layers (0:e), on every rank
    stage: nn.Module  # a StageModule over this rank's LLM layers
    model: object  # the LayerModel: carriers and the encoder hooks
    bounds: list[int]  # LLM partition: [e, ..., n_layers]
    microbatches: int
    schedule: str = "1f1b"
    dtype: torch.dtype = torch.float32
    channel: Channel | None = None
    modules: list[nn.Module] = field(default_factory=list)
    last_stats: dict[str, float] = field(default_factory=dict)  # this rank's encoder seconds in the last step

    def __post_init__(self):
        self.modules = [self.stage]
        if self.channel is None:
            self.channel = Channel(self.mesh)

    def run(self, shape: StepShape, args: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
        step = BubbleStep(self, shape, args)
        step.execute()
        self.last_stats = {"encoder_s": step.encoder_s, "encoder_in_bubbles_s": step.filled_s}
        self.sync_gradients()
        return [loss / self.mesh.dp for loss in step.losses]

    def sync_gradients(self) -> None:
        """LLM gradients averaged over the stage's DP group; the encoder's summed over every rank / DP."""
        mesh = self.mesh
        if mesh.dp > 1:
            all_reduce_gradients([p for p in self.stage.parameters()], mesh.dp_group, 1.0 / mesh.dp)
        if mesh.dp * mesh.pp > 1:
            all_reduce_gradients(list(self.encoder.parameters()), None, 1.0 / mesh.dp)


class BubbleStep:
    """One step's state on one rank. Its hooks, which a layout that feeds the stages otherwise overrides (the
    encoder on ranks of its own: `disaggregated.FedFirstStageStep`): `encoder_shares` (which rank encodes how
    much of each microbatch), `stage_inputs` (what a stage's forward of microbatch j takes) and `llm_backward`
    (a stage's backward of microbatch j)."""

    def __init__(self, runner: BubbleRunner, shape: StepShape, args: tuple[torch.Tensor, ...] | None):
        self.runner, self.shape, self.mesh = runner, shape, runner.mesh
        self.m, self.pp, self.me = runner.microbatches, runner.mesh.pp, runner.mesh.stage
        self.channel = runner.channel
        self.sends: list[dist.Work] = []
        self.losses: list[torch.Tensor] = []
        self.args = [tuple(a.tensor_split(self.m)[j] for a in args) for j in range(self.m)] if args else None
        self.shares = self.encoder_shares()
        self.offsets = self.shares.cumsum(axis=1) - self.shares  # first tile of each rank's share
        self.pixels = self._my_pixels()
        self.order = pipeline_order(runner.schedule, self.me, self.pp, self.m)
        self.deadline = self._deadlines()
        # encoder work: forwards in microbatch order, then backwards as their gradients arrive
        self.to_encode = [j for j in range(self.m) if self.shares[j, self.me] > 0]
        self.encoding: tuple[int, Iterator] | None = None
        self.encoded: dict[int, torch.Tensor] = {}  # my share's features (with their graph) until its backward
        self.feature_grads = {j: self._recv_feature_grads(j) for j in self.to_encode} if self.me else {}
        self.local_grads: dict[int, torch.Tensor] = {}
        self.features_in = self._recv_features() if self.me == 0 else {}
        self.saved: dict[int, tuple] = {}
        self.encoder_s = 0.0  # encoder work on this rank
        self.filled_s = 0.0  # ... of it while the next LLM operation waited for a message

    # --- set-up ------------------------------------------------------------------------------------------
    def encoder_shares(self):
        counts = torch.zeros(self.m, dtype=torch.int64, device=self.mesh.device)
        if self.me == 0:
            counts = torch.tensor([self.runner.model.vision_units(a) for a in self.args], dtype=torch.int64,
                                  device=self.mesh.device)
        if self.pp > 1:
            dist.broadcast(counts, src=self.mesh.first_stage_rank, group=self.mesh.pp_group)
        return split_tiles(counts.cpu().tolist(), self.pp)

    def _features_like(self, units: int) -> torch.Tensor:
        return self.runner.model.vision_output_like(units, self.mesh.device, self.runner.dtype)

    def _my_pixels(self) -> dict[int, torch.Tensor]:
        """The pixels of this rank's share of every microbatch (the first stage sends them)."""
        model, axis = self.runner.model, self.runner.model.vision.input_axis
        mine = [j for j in range(self.m) if self.shares[j, self.me]]

        def share(j: int, k: int) -> torch.Tensor:
            return model.vision_input(self.args[j]).narrow(axis, int(self.offsets[j, k]), int(self.shares[j, k]))

        if self.me == 0:
            for k in range(1, self.pp):
                theirs = [share(j, k) for j in range(self.m) if self.shares[j, k]]
                if theirs:
                    self.sends.append(self.channel.send(torch.cat(theirs, dim=axis), k, message_tag(PIXELS, 0)))
            return {j: share(j, 0) for j in mine}
        if not mine:
            return {}
        like = model.vision_input_like(int(self.shares[:, self.me].sum()), self.mesh.device)
        pixels = self.channel.recv(like, 0, message_tag(PIXELS, 0)).take()
        return dict(zip(mine, pixels.split([int(self.shares[j, self.me]) for j in mine], dim=axis)))

    def _deadlines(self) -> dict[int, list[int]]:
        """Microbatch i -> the encoder forwards (their microbatches) to finish before this rank's B(i): the
        simulator's rule (`encoder_deadlines`), turned round."""
        due: dict[int, list[int]] = {}
        for j, backwards in encoder_deadlines(self.runner.schedule, self.pp, self.m).items():
            for _, i in backwards:
                due.setdefault(i, []).append(j)
        return due

    def _recv_feature_grads(self, j: int) -> Pending:
        return self.channel.recv(self._features_like(int(self.shares[j, self.me])), 0, message_tag(FEATURE_GRADS, j))

    def _recv_features(self) -> dict[tuple[int, int], Pending]:
        return {(j, k): self.channel.recv(self._features_like(int(self.shares[j, k])), k, message_tag(FEATURES, j))
                for j in range(self.m) for k in range(1, self.pp) if self.shares[j, k]}

    # --- encoder work --------------------------------------------------------------------------------------
    def _encode(self, j: int) -> Iterator[None]:
        """My share of microbatch j through the encoder, one layer per step of the iterator."""
        encoder = self.runner.encoder
        carrier = self.runner.model.encoder_carrier(self.pixels[j])
        with torch.autocast(self.mesh.device.type, dtype=encoder.autocast or torch.float32,
                            enabled=encoder.autocast is not None):
            for layer in encoder.layers.values():
                carrier = layer(*carrier)
                yield
        features = self.runner.model.encoder_output(carrier)
        if encoder.autocast is not None:
            features = features.to(encoder.autocast)
        self.encoded[j] = features
        if self.me:
            self.sends.append(self.channel.send(features, 0, message_tag(FEATURES, j)))

    def _forward_unit(self) -> bool:
        """One encoder layer of my next share's forward; False when every share is encoded."""
        if self.encoding is None:
            if not self.to_encode:
                return False
            j = self.to_encode.pop(0)
            self.encoding = (j, self._encode(j))
        started = time.perf_counter()
        try:
            next(self.encoding[1])
        except StopIteration:
            self.encoding = None
        self.encoder_s += time.perf_counter() - started
        return True

    def _finish_forward(self, j: int) -> None:
        while j not in self.encoded:
            self._forward_unit()

    def _backward_unit(self, wait: bool = False) -> bool:
        """The encoder backward of one share whose gradient is here (or, `wait`, the next one to come)."""
        ready = [j for j in self.local_grads] + [j for j, p in self.feature_grads.items() if p.ready()]
        if not ready and wait and self.feature_grads:
            ready = [min(self.feature_grads)]
        if not ready:
            if wait:
                raise RuntimeError(f"encoder shares {sorted(self.encoded)} never got their gradients")
            return False
        j = min(ready)
        grad = self.local_grads.pop(j) if j in self.local_grads else self.feature_grads.pop(j).take()
        started = time.perf_counter()
        torch.autograd.backward(self.encoded.pop(j), grad)
        self.encoder_s += time.perf_counter() - started
        return True

    def _wait(self, pending: Pending) -> torch.Tensor:
        """The message, running encoder work (one layer at a time) until it is here."""
        before = self.encoder_s
        while not pending.ready() and (self._forward_unit() or self._backward_unit()):
            pass
        self.filled_s += self.encoder_s - before
        return pending.take()

    # --- LLM operations ------------------------------------------------------------------------------------
    def execute(self) -> None:
        for kind, _, j in self.order:
            if kind == "F":
                self._llm_forward(j)
            else:
                for due in self.deadline.get(j, []):
                    if self.shares[due, self.me]:
                        self._finish_forward(due)
                self.llm_backward(j)
        while self._forward_unit():
            pass
        while self.encoded:
            self._backward_unit(wait=True)
        for work in self.sends:
            work.wait()

    def stage_inputs(self, j: int) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        """The carrier entering my stage for microbatch j, and its tensors that collect gradients."""
        if self.me == 0:
            if self.shares[j, 0]:
                self._finish_forward(j)
            parts = []
            for k in range(self.pp):
                if self.shares[j, k]:
                    parts.append(self.encoded[j].detach() if k == 0 else self._wait(self.features_in.pop((j, k))))
            features = torch.cat(parts, dim=self.runner.model.vision.output_axis) if parts else \
                self._features_like(0).zero_()
            features.requires_grad_(True)
            return self.runner.model.llm_carrier(self.args[j], features, self.shape), [features]
        like = self.runner.model.carrier(self.runner.bounds[self.me], self.shape, self.mesh.device, self.runner.dtype)
        received = [self._wait(self.channel.recv(t, self.me - 1, message_tag(ACTIVATIONS, j, i)))
                    for i, t in enumerate(like)]
        inputs = tuple(t.requires_grad_(t.is_floating_point()) for t in received)
        return inputs, [t for t in inputs if t.is_floating_point()]

    def _llm_forward(self, j: int) -> None:
        inputs, leaves = self.stage_inputs(j)
        outputs = self.runner.stage(*inputs)
        if self.me == self.pp - 1:
            normaliser = max(self.shape.step_loss_tokens, 1) / self.mesh.dp
            loss = outputs[0].sum() / normaliser
            self.losses.append(loss.detach())
            self.saved[j] = (leaves, [loss])
        else:
            for i, t in enumerate(outputs):
                self.sends.append(self.channel.send(t, self.me + 1, message_tag(ACTIVATIONS, j, i)))
            self.saved[j] = (leaves, [t for t in outputs if t.is_floating_point()])

    def llm_backward(self, j: int) -> None:
        """The next stage sends a gradient for each float tensor it received (zeros where none flowed)."""
        leaves, outputs = self.saved.pop(j)
        if self.me == self.pp - 1:
            torch.autograd.backward(outputs)
        else:
            grads = [self._wait(self.channel.recv(t, self.me + 1, message_tag(GRADS, j, i)))
                     for i, t in enumerate(outputs)]
            pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if self.me > 0:
            for i, leaf in enumerate(leaves):
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self.sends.append(self.channel.send(grad, self.me - 1, message_tag(GRADS, j, i)))
            return
        (features,) = leaves
        owners = [k for k in range(self.pp) if self.shares[j, k]]
        if not owners:
            return
        grad = features.grad if features.grad is not None else torch.zeros_like(features)
        vision = self.runner.model.vision
        sizes = [int(self.shares[j, k]) * vision.output_per_unit for k in owners]
        for k, grad in zip(owners, grad.split(sizes, dim=vision.output_axis)):
            if k == 0:
                self.local_grads[j] = grad
            else:
                self.sends.append(self.channel.send(grad, k, message_tag(FEATURE_GRADS, j)))
