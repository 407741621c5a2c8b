"""The encoder on ranks of its own (`parallel.encoder=disaggregated parallel.encoder_ranks=E`; DistTrain): E
processes run the vision encoder and projector, the dp processes the LLM, each side with its own data parallelism.

Each encoder rank streams its own packs (`PackStream(..., encoder_rank=e)`): only the images it encodes for the
step's microbatches of every LLM rank, named by (LLM rank, microbatch, planned position, image number); each LLM
rank streams its packs without pixels, with the encoder rank of every image it consumes. One step:
1. Every encoder rank encodes its images of microbatch m (the plan balanced the step's encoder work over the E
   ranks on the encoder's own cost).
2. A forward all-to-all over every rank (`packfeed.trainer.parallel.phases.Exchange`, with encoder rank e at
   global rank dp + e) hands each output to its LLM rank; an LLM rank sends nothing, an encoder rank receives
   nothing. The encoder ranks then encode microbatch m + 1 while the LLM ranks train on m.
3. The LLM ranks run forward and backward on each microbatch, their vision features leaves; a backward
   all-to-all returns microbatch m's image gradients to their encoder ranks, which hand microbatch m + 1 over
   and then run m's encoder backward while the LLM trains on m + 1.
4. The LLM's gradients are averaged over the dp LLM ranks, as DDP does; the encoder's are summed over the E
   encoder ranks and divided by dp (each LLM rank's loss was scaled by dp / the step's loss tokens). The loss and
   every gradient then equal colocated training on the same packs.

The collectives run on the world group: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from packfeed.trainer.batch import Microbatches, RoutedImages, StepShape
from packfeed.trainer.models.layer_model import features_of_carrier
from packfeed.trainer.parallel.data_parallel import all_reduce_gradients
from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.phases import Exchange, PhaseRunner
from packfeed.trainer.parallel.pipeline import StageModule, autocast_dtype
from packfeed.trainer.parallel.profile import synchronize
from packfeed.trainer.parallel.runner import StepTally


class EncoderRanksStep(PhaseRunner):
    """`PhaseRunner`'s step with the two sides on different ranks, two exchanges per microbatch: an encoder rank
    encodes microbatch m + 1 while the LLM ranks train on microbatch m, and runs m's backward while they train on
    m + 1. Each side's gradients are completed over its own ranks."""

    def exchange(self) -> Exchange:
        return Exchange(self.mesh, self.model, peers=self.mesh.world, encoder_offset=self.mesh.dp)

    def run(self, shape: StepShape, batch: Microbatches) -> list[torch.Tensor]:
        """Every rank runs the same collectives in the same order: per microbatch m, the forward exchange, then
        the backward exchange. In between, an encoder rank encodes m + 1 (while the LLM trains on m); after
        handing m + 1 over it runs m's backward (while the LLM trains on m + 1)."""
        started = time.perf_counter()
        routed, self._encoder_s = batch.routed, 0.0
        args = self._llm_args(batch) if self.stage is not None else []
        exchanges, losses = [], []
        encoded = self._encoded(routed, 0)
        received = self._hand_over(routed, 0, encoded, exchanges)
        for m, images in enumerate(routed):
            grads: dict = {}
            if self.stage is not None:
                losses.append(self._train_microbatch(shape, m, args[m], images, exchanges[m], received, grads))
            following = self._encoded(routed, m + 1) if m + 1 < len(routed) else None
            back = exchanges[m].backward(grads, encoded.shape[0])
            if following is not None:
                received = self._hand_over(routed, m + 1, following, exchanges)
            self._encoder_backward(encoded, back)
            encoded = following
        self.sync_gradients()
        self.last_stats = {"encoder_s": self._encoder_s, "all_to_all_s": sum(e.seconds for e in exchanges),
                           "all_to_all_bytes": float(sum(e.bytes_sent for e in exchanges)),
                           "phases_step_s": time.perf_counter() - started}
        return [loss / self.mesh.dp for loss in losses]

    def _encoded(self, routed: list[RoutedImages], m: int) -> torch.Tensor:
        features, seconds = self._encode([routed[m]])
        self._encoder_s += seconds
        return features

    def _hand_over(self, routed: list[RoutedImages], m: int, encoded: torch.Tensor, exchanges: list) -> torch.Tensor:
        """Microbatch m's forward exchange (its images' keys keep m); what this rank received."""
        exchange = self.exchange()
        exchanges.append(exchange)
        only_m = [images if k == m else EMPTY for k, images in enumerate(routed)]
        return exchange.forward(encoded, self._send_order(only_m), only_m)

    def _encoder_backward(self, encoded: torch.Tensor, grads: torch.Tensor) -> None:
        started = time.perf_counter()
        if encoded.requires_grad and encoded.numel():
            torch.autograd.backward(encoded, grads.to(encoded.dtype))
        self._encoder_s += time.perf_counter() - started

    def sync_gradients(self) -> None:
        mesh = self.mesh
        module = self.encoder if mesh.is_encoder else self.stage
        peers = mesh.encoder_ranks if mesh.is_encoder else mesh.dp
        if peers > 1:
            all_reduce_gradients(list(module.parameters()), mesh.dp_group, 1.0 / mesh.dp)
            return
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if grads:  # one rank on this side: nothing to sum, only the scale
            torch._foreach_mul_(grads, 1.0 / mesh.dp)


EMPTY = RoutedImages(torch.zeros(0), [], [])  # a microbatch with nothing to send


@dataclass
class DisaggregatedRunner:
    """The `StepRunner` of a rank of either side: its layers (the encoder's 0:e, or the LLM's e:n), its stream's
    steps, and `EncoderRanksStep` to train them."""

    mesh: Mesh
    model: Any  # the reference LayerModel (its vision encoder separates from its LLM)
    source: Any  # this rank's StepSource (an LLM rank's packs, or an encoder rank's)
    microbatches: int
    precision: str = "fp32"
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise ValueError(f"parallel.encoder=disaggregated needs a model whose vision encoder separates from its "
                             f"LLM; {self.model.describe()} does not")
        first, n = vision.encoder_layers, len(self.model.kinds)
        lo, hi = (0, first) if self.mesh.is_encoder else (first, n)
        for i, layer in enumerate(self.model.layers):  # the other side's layers stay on the CPU, unused
            layer.to(self.mesh.device if lo <= i < hi else "cpu")
        autocast = autocast_dtype(self.precision)
        self.module = StageModule(self.model.layers, lo, hi, None, autocast, hi == n)
        encoder, stage = (self.module, None) if self.mesh.is_encoder else (None, self.module)
        self.step = EncoderRanksStep(self.mesh, encoder, stage, self.model, self.microbatches,
                                     autocast or torch.float32)
        self.meta = {"encoder_ranks": self.mesh.encoder_ranks, "encoder_layers": [0, first]}

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def checkpoint_module(self) -> torch.nn.Module:
        """This side's layers under their index in the model (the other side's ranks save the rest)."""
        holder = torch.nn.Module()
        holder.layers = self.module.layers
        return holder

    def agree(self, batch: Microbatches | None) -> StepShape:
        """Every rank of both sides has the same step, or the run stops on all. The LLM ranks' shape (its loss
        tokens) is theirs; an encoder rank's packs hold no LLM side."""
        position = (batch.shape.epoch, batch.shape.step) if batch is not None else (-1, -1)
        mine = torch.tensor([0 if batch is None else 1, *position], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.mesh.world)]
        dist.all_gather(everyone, mine)
        if not all(int(t[0]) for t in everyone):
            return StepShape(0, 0, 0, 0, stop=True)
        positions = {tuple(t[1:].tolist()) for t in everyone}
        if len(positions) > 1:  # streams at different steps would pair images with the wrong packs
            raise RuntimeError(f"the ranks' streams stand at different steps {sorted(positions)}: every LLM and "
                               "encoder rank must stream the same job from the same position")
        return batch.shape

    def train_step(self, shape: StepShape, batch: Microbatches | None) -> StepTally:
        started, busy_started = time.perf_counter(), time.process_time()
        losses = self.step.run(shape, batch)
        busy = time.process_time() - busy_started if self.mesh.device.type == "cpu" else float("nan")
        tally = StepTally(float(sum(loss.item() for loss in losses)), busy_s=busy,
                          compute_s=time.perf_counter() - started, stats=dict(self.step.last_stats))
        mesh, m = self.mesh, self.microbatches
        if not mesh.is_encoder:
            tally.tokens, tally.padded_tokens = batch.real_tokens, shape.tokens * m
            tally.samples_by_dataset = batch.samples_by_dataset
            features = [features_of_carrier(batch.microbatch(k, m)) for k in range(m)]
            tally.rows["llm_microbatches"] = [(mesh.rank, k, f.tokens, f.tiles, f.square)
                                              for k, f in enumerate(features)]
        else:
            tally.tiles = tally.padded_tiles = sum(int(images.encode_input.shape[0]) for images in batch.routed)
            tally.rows["encoder_work"] = [(mesh.encoder_rank, consumer, k, units) for k, images in
                                          enumerate(batch.routed) for consumer, _, _, units in images.encoded]
        return tally

    def clip_gradients(self, max_norm: float) -> float:
        """The norm over the whole model: each side's (replicated over its ranks) counted once, by its first
        rank."""
        mesh = self.mesh
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=mesh.device)
        if mesh.rank in (0, mesh.dp):  # LLM rank 0 and encoder rank 0
            for grad in grads:
                squares += grad.detach().double().pow(2).sum()
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        if max_norm > 0 and norm > max_norm and grads:
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
        return norm

    def sync(self) -> None:
        synchronize(self.mesh.device)
