"""Every phase balanced on its own, executed (`parallel.encoder=phases`, plan strategy isf+phases; OrchMLLM):
each data-parallel rank encodes the images the plan assigns it — its packs carry those (`encode_target`), whoever
consumes them — and one all-to-all per step hands every encoder output to the rank whose pack consumes it;
another returns their gradients.

One step on one rank:
1. The encoder runs once over every image this rank encodes for the step's M microbatches (one balanced share
   of the step's encoder work: the plan balanced it per step, not per microbatch).
2. Forward all-to-all, over the DP group: first the number of images for each rank, then what each image is
   (microbatch, planned position of its sample, its number in the sample, units), then the features. Both
   sides name an image the same way, so the consumer places each where its pack's placeholders expect it. An
   image missing on either side (its sample skipped by one server, a shard changed since indexing) leaves its
   sample out of the loss: its labels are ignored and its features are zeros.
3. The LLM runs forward and backward on each microbatch in turn, its vision features a leaf that collects
   their gradient.
4. Backward all-to-all: each image's gradient goes back to the rank that encoded it, in the order it came;
   the encoder's backward runs once.
5. Gradients are averaged over the DP group, as DDP does: the loss and every gradient equal colocated
   encoding (`colocate_encoder`, every rank encoding its own packs' images) on the same packs.

The all-to-all runs on the DP group's backend: gloo on CPU, NCCL on CUDA (it has all_to_all_single natively).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from packfeed.trainer.batch import Microbatches, RoutedImages, StepShape
from packfeed.trainer.parallel.data_parallel import all_reduce_gradients
from packfeed.trainer.parallel.mesh import Mesh

HEADER = 4  # microbatch, position, image number, units


@dataclass
class PhaseRunner:
    """Runs one step with the encoder's work routed (see the module docstring); pp = 1. With the encoder on ranks
    of its own (`packfeed.trainer.parallel.disaggregated`) a rank holds one side: `stage` None on an encoder
    rank, `encoder` None on an LLM rank; that layout reuses the steps of this one: `encode`, `send_order`,
    `llm_args` and `train_microbatch`."""

    mesh: Mesh
    encoder: nn.Module | None  # a StageModule over the model's encoder layers (0:e)
    stage: nn.Module | None  # a StageModule over the LLM's layers (e:n), ending the model
    model: object  # the LayerModel: carriers and the encoder hooks
    microbatches: int
    dtype: torch.dtype = torch.float32
    modules: list[nn.Module] = field(default_factory=list)
    last_stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.modules = [self.stage] if self.stage is not None else []

    def run(self, shape: StepShape, batch: Microbatches) -> list[torch.Tensor]:
        if batch.routed is None:
            raise ValueError("parallel.encoder=phases needs routed packs: open the job with plan strategy isf+phases "
                             "(without colocate_encoder)")
        started = time.perf_counter()
        routed = batch.routed
        features, encoder_s = self.encode(routed)
        exchange = self.exchange()
        received = exchange.forward(features, self.send_order(routed), routed)
        losses, received_grads = self._train_llm(shape, batch, exchange, received) if self.stage is not None \
            else ([], {})
        grads = exchange.backward(received_grads, features.shape[0])
        backward_started = time.perf_counter()
        if features.requires_grad and features.numel():
            torch.autograd.backward(features, grads.to(features.dtype))
        encoder_s += time.perf_counter() - backward_started
        self.sync_gradients()
        self.last_stats = {"encoder_s": encoder_s, "all_to_all_s": exchange.seconds,
                           "all_to_all_bytes": float(exchange.bytes_sent), "phases_step_s": time.perf_counter() - started}
        return [loss / self.mesh.dp for loss in losses]

    def exchange(self) -> Exchange:
        return Exchange(self.mesh, self.model)

    def _train_llm(self, shape: StepShape, batch: Microbatches, exchange: Exchange, received: torch.Tensor):
        """Forward and backward of the LLM on each microbatch, its vision features what `exchange` received;
        returns the losses and the gradient of each received image."""
        losses, received_grads = [], {}
        for m, args in enumerate(self.llm_args(batch)):
            losses.append(self.train_microbatch(shape, m, args, batch.routed[m], exchange, received, received_grads))
        return losses, received_grads

    def llm_args(self, batch: Microbatches) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(a.to(self.mesh.device).tensor_split(self.microbatches)[m] for a in batch.args)
                for m in range(self.microbatches)]

    def train_microbatch(self, shape: StepShape, m: int, args: tuple, images: RoutedImages, exchange: Exchange,
                          received: torch.Tensor, received_grads: dict) -> torch.Tensor:
        """The LLM's forward and backward on microbatch m (its loss, detached); each received image's gradient
        into `received_grads`."""
        leaf, pieces, missing = exchange.features_of(m, images, received)
        microbatch = self.model.without_samples(args, missing) if missing else args
        carrier = self.model.llm_carrier(microbatch, leaf, shape)
        loss = self.stage(*carrier)[0].sum() / (max(shape.step_loss_tokens, 1) / self.mesh.dp)
        loss.backward()
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        for key, (start, units) in pieces.items():
            received_grads[key] = grad.narrow(0, start, units)
        return loss.detach()

    def encode(self, routed: list[RoutedImages]) -> tuple[torch.Tensor, float]:
        """Features of every image encoded here, all microbatches' together, in microbatch then image order."""
        started = time.perf_counter()
        pixels = torch.cat([images.encode_input for images in routed]).to(self.mesh.device)
        if pixels.shape[0] == 0 or self.encoder is None:
            return self.model.vision_output_like(0, self.mesh.device, self.dtype).zero_(), 0.0
        carrier = self.model.encoder_carrier(pixels)
        with torch.autocast(self.mesh.device.type, dtype=self.encoder.autocast or torch.float32,
                            enabled=self.encoder.autocast is not None):
            for layer in self.encoder.layers.values():
                carrier = layer(*carrier)
        features = self.model.encoder_output(carrier)
        return features, time.perf_counter() - started

    @staticmethod
    def send_order(routed: list[RoutedImages]) -> dict[int, list[tuple[tuple[int, int, int, int], int, int]]]:
        """Per consumer rank: ((microbatch, position, number, units), first unit here, units) of each image it gets
        from this rank, in (microbatch, position, number) order: the order the consumer derives too."""
        sends: dict[int, list] = {}
        offset = 0
        for m, images in enumerate(routed):
            for consumer, position, number, units in images.encoded:
                sends.setdefault(consumer, []).append(((m, position, number, units), offset, units))
                offset += units
        for rows in sends.values():
            rows.sort(key=lambda row: row[0][:3])
        return sends

    def sync_gradients(self) -> None:
        """Every gradient averaged over the DP group (as DDP would: the loss was divided by the step's tokens / DP)."""
        if self.mesh.dp > 1:
            all_reduce_gradients(list(self.encoder.parameters()) + list(self.stage.parameters()), self.mesh.dp_group,
                                 1.0 / self.mesh.dp)


class Exchange:
    """The step's two all-to-alls over the DP group, and where each received image lands. With the encoder on
    ranks of its own (`packfeed.trainer.parallel.disaggregated`) they run over the mesh's `exchange_group` (`peers`
    = the dp first stages, then the encoder ranks), and a pack's encoder rank e is peer `encoder_offset` + e."""

    def __init__(self, mesh: Mesh, model, peers: int | None = None, encoder_offset: int = 0):
        self.mesh, self.model = mesh, model
        self.peers = peers or mesh.dp
        self.group = (mesh.dp_group if peers is None else mesh.exchange_group) if self.peers > 1 else None
        self.encoder_offset = encoder_offset
        self.seconds = 0.0
        self.bytes_sent = 0
        self.sent: list[tuple[int, int]] = []  # (first unit, units) of each row sent, in send order
        self.send_units: list[int] = []
        self.recv_units: list[int] = []
        self.received_keys: list[tuple[int, int, int, int, int]] = []  # (source, microbatch, position, number, units)
        self.received_at: dict[tuple[int, int, int, int], tuple[int, int]] = {}  # key -> (first unit, units)
        self.unit_shape: tuple[int, ...] = ()

    def _all_to_all(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        out = send.new_empty((sum(recv_rows), *send.shape[1:]))
        if self.group is None:
            out.copy_(send)
        else:
            dist.all_to_all_single(out, send.contiguous(), recv_rows, send_rows, group=self.group)
        self.seconds += time.perf_counter() - started
        self.bytes_sent += send.numel() * send.element_size()
        return out

    def forward(self, features: torch.Tensor, sends: dict, routed: list[RoutedImages]) -> torch.Tensor:
        dp, device = self.peers, self.mesh.device
        self.unit_shape = tuple(features.shape[1:]) if features.numel() else \
            tuple(self.model.vision_output_like(0, device, features.dtype).shape[1:])
        rows = [sends.get(d, []) for d in range(dp)]
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
        recv_counts = self._all_to_all(counts, [1] * dp, [1] * dp).tolist()
        headers = torch.tensor([key for r in rows for key, _, _ in r], dtype=torch.int64,
                               device=device).view(-1, HEADER)
        got = self._all_to_all(headers, [len(r) for r in rows], recv_counts).tolist()
        sources = [s for s, n in enumerate(recv_counts) for _ in range(n)]
        self.received_keys = [(source, *key) for source, key in zip(sources, got)]
        self.sent = [(first, units) for r in rows for _, first, units in r]
        self.send_units = [sum(units for _, _, units in r) for r in rows]
        self.recv_units = [0] * dp
        offset = 0
        for source, microbatch, position, number, units in self.received_keys:
            self.recv_units[source] += units
            self.received_at[(source, microbatch, position, number)] = (offset, units)
            offset += units
        payload = torch.cat([features.narrow(0, first, units) for first, units in self.sent]) if self.sent else \
            features.new_zeros((0, *self.unit_shape))
        return self._all_to_all(payload.detach(), self.send_units, self.recv_units)

    def features_of(self, m: int, images: RoutedImages, received: torch.Tensor):
        """Microbatch m's vision features (a leaf, in its images' order), where each received image lies in it,
        and the samples whose images did not come (left out of the loss)."""
        parts, pieces, missing, start = [], {}, set(), 0
        for encoder, position, number, units, sample in images.consumed:
            encoder += self.encoder_offset
            found = self.received_at.get((encoder, m, position, number))
            if found is None or found[1] != units:
                parts.append(received.new_zeros((units, *self.unit_shape)))
                missing.add(sample)
            else:
                parts.append(received.narrow(0, found[0], units))
                pieces[(encoder, m, position, number)] = (start, units)
            start += units
        leaf = torch.cat(parts) if parts else received.new_zeros((0, *self.unit_shape))
        return leaf.detach().requires_grad_(True), pieces, missing

    def backward(self, grads: dict, units_encoded: int) -> torch.Tensor:
        """The gradient of every image this rank encoded, in its features' order (zeros where none came back)."""
        rows = []
        for source, microbatch, position, number, units in self.received_keys:
            grad = grads.get((source, microbatch, position, number))
            rows.append(grad if grad is not None else torch.zeros((units, *self.unit_shape), device=self.mesh.device))
        payload = torch.cat(rows).float() if rows else torch.zeros((0, *self.unit_shape), device=self.mesh.device)
        back = self._all_to_all(payload, self.recv_units, self.send_units)
        out = torch.zeros((units_encoded, *self.unit_shape), device=self.mesh.device)
        offset = 0
        for first, units in self.sent:
            out[first:first + units] = back[offset:offset + units]
            offset += units
        return out
