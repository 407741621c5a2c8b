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

With the LLM pipelined (pp > 1) the dp x pp LLM ranks run the 1F1B (or GPipe) schedule of
`packfeed.trainer.parallel.bubbles` with no encoder work of their own (`FedFirstStageStep`), and the exchanges
run over the first stages and the encoder ranks (`Mesh.exchange_group`), in the first stage's order of
operations (`pipeline_order(schedule, 0, pp, M)`), which every member replays: microbatch j's forward exchange
right before the first stage's F(j), its backward exchange right after its B(j). An encoder rank encodes j + 1
once it has handed j over and runs j's backward once j's gradients are back; the later stages exchange only
activations and their gradients with their replica, as without encoder ranks. Each stage's gradients are
averaged over its replicas.

The collectives run on the world group (pp 1) or the exchange group: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from packfeed.trainer.batch import Microbatches, RoutedImages, StepShape
from packfeed.trainer.models.layer_model import features_of_carrier
from packfeed.trainer.parallel.bubbles import BubbleRunner, BubbleStep, Channel
from packfeed.trainer.parallel.data_parallel import all_reduce_gradients
from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.phases import Exchange, PhaseRunner
from packfeed.trainer.parallel.pipeline import StageModule, autocast_dtype, separate_encoder_layers, \
    share_step_shape, validate_partition
from packfeed.trainer.parallel.runner import StepTally
from packfeed.trainer.parallel.schedules import pipeline_order


@dataclass
class EncoderRanksStep(PhaseRunner):
    """`PhaseRunner`'s step with the two sides on different ranks, two exchanges per microbatch: an encoder rank
    encodes microbatch m + 1 while the LLM ranks train on microbatch m, and runs m's backward while they train on
    m + 1. Each side's gradients are completed over its own ranks. `pipeline`: an LLM rank's schedule at pp > 1."""

    pipeline: BubbleRunner | None = None
    schedule: str = "1f1b"

    def exchange(self) -> Exchange:
        mesh = self.mesh
        return Exchange(mesh, self.model, peers=mesh.dp + mesh.encoder_ranks, encoder_offset=mesh.dp)

    def run(self, shape: StepShape, batch: Microbatches) -> list[torch.Tensor]:
        """Every rank runs the same collectives in the same order: per microbatch m, the forward exchange, then
        the backward exchange. In between, an encoder rank encodes m + 1 (while the LLM trains on m); after
        handing m + 1 over it runs m's backward (while the LLM trains on m + 1)."""
        if self.mesh.pp > 1:
            return self._run_pipelined(shape, batch)
        started = time.perf_counter()
        routed, self._encoder_s = batch.routed, 0.0
        args = self.llm_args(batch) if self.stage is not None else []
        exchanges, losses = [], []
        encoded = self._encoded(routed, 0)
        received = self._hand_over(routed, 0, encoded, exchanges)
        for m, images in enumerate(routed):
            grads: dict = {}
            if self.stage is not None:
                losses.append(self.train_microbatch(shape, m, args[m], images, exchanges[m], received, grads))
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

    def _run_pipelined(self, shape: StepShape, batch: Microbatches | None) -> list[torch.Tensor]:
        """pp > 1: an LLM rank runs its stage's schedule; an encoder rank feeds the first stages in their order."""
        started, self._encoder_s = time.perf_counter(), 0.0
        exchanges: list[Exchange] = []
        if self.mesh.is_encoder:
            losses = []
            self._feed_first_stages(batch.routed, exchanges)
        else:
            args = [a.to(self.mesh.device) for a in batch.args] if batch is not None else None
            step = FedFirstStageStep(self.pipeline, shape, args, self, batch.routed if batch is not None else [],
                                     exchanges)
            step.execute()
            losses = step.losses
        self.sync_gradients()
        self.last_stats = {"encoder_s": self._encoder_s, "all_to_all_s": sum(e.seconds for e in exchanges),
                           "all_to_all_bytes": float(sum(e.bytes_sent for e in exchanges)),
                           "phases_step_s": time.perf_counter() - started}
        return [loss / self.mesh.dp for loss in losses]

    def _feed_first_stages(self, routed: list[RoutedImages], exchanges: list[Exchange]) -> None:
        """An encoder rank replays the first stage's order: hands microbatch j over before its F(j), then encodes
        j + 1; takes j's gradients after its B(j) and runs j's encoder backward."""
        encoded = {0: self._encoded(routed, 0)}
        for kind, _, j in pipeline_order(self.schedule, 0, self.mesh.pp, len(routed)):
            if kind == "F":
                self._hand_over(routed, j, encoded[j], exchanges)
                if j + 1 < len(routed):
                    encoded[j + 1] = self._encoded(routed, j + 1)
            else:
                back = exchanges[j].backward({}, encoded[j].shape[0])
                self._encoder_backward(encoded.pop(j), back)

    def _encoded(self, routed: list[RoutedImages], m: int) -> torch.Tensor:
        features, seconds = self.encode([routed[m]])
        self._encoder_s += seconds
        return features

    def _hand_over(self, routed: list[RoutedImages], m: int, encoded: torch.Tensor, exchanges: list) -> torch.Tensor:
        """Microbatch m's forward exchange (its images' keys keep m); what this rank received."""
        exchange = self.exchange()
        exchanges.append(exchange)
        only_m = only_microbatch(routed, m)
        return exchange.forward(encoded, self.send_order(only_m), only_m)

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


def only_microbatch(routed: list[RoutedImages], m: int) -> list[RoutedImages]:
    """Microbatch m's images, the other microbatches' left out (one microbatch's exchange)."""
    return [images if k == m else EMPTY for k, images in enumerate(routed)]


class FedFirstStageStep(BubbleStep):
    """An LLM rank's step at pp > 1: `BubbleStep`'s schedule with no encoder share on any rank; the first stage
    takes microbatch j's vision features from the encoder ranks (an exchange before its F(j)) and returns their
    gradients after its B(j)."""

    def __init__(self, runner: BubbleRunner, shape: StepShape, args: list[torch.Tensor] | None, feed: EncoderRanksStep,
                 routed: list[RoutedImages], exchanges: list[Exchange]):
        self.feed, self.routed, self.exchanges = feed, routed, exchanges
        self.fed: dict[int, tuple[Exchange, torch.Tensor, dict]] = {}  # microbatch -> its exchange, leaf, pieces
        super().__init__(runner, shape, args)

    def encoder_shares(self) -> np.ndarray:
        return np.zeros((self.m, self.pp), dtype=np.int64)  # the encoder runs on ranks of its own

    def stage_inputs(self, j: int):
        if self.me:
            return super().stage_inputs(j)
        exchange = self.feed.exchange()
        self.exchanges.append(exchange)
        nothing = self.runner.model.vision_output_like(0, self.mesh.device, self.runner.dtype).zero_()
        received = exchange.forward(nothing, {}, only_microbatch(self.routed, j))
        leaf, pieces, missing = exchange.features_of(j, self.routed[j], received)
        args = self.runner.model.without_samples(self.args[j], missing) if missing else self.args[j]
        self.fed[j] = (exchange, leaf, pieces)
        return self.runner.model.llm_carrier(args, leaf, self.shape), [leaf]

    def llm_backward(self, j: int) -> None:
        super().llm_backward(j)
        if self.me == 0:
            exchange, leaf, pieces = self.fed.pop(j)
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            exchange.backward({key: grad.narrow(0, start, units) for key, (start, units) in pieces.items()}, 0)


@dataclass
class DisaggregatedRunner:
    """The `StepRunner` of a rank of either side: its layers (the encoder's 0:e, or the LLM's e:n), its stream's
    steps, and `EncoderRanksStep` to train them."""

    mesh: Mesh
    model: Any  # the reference LayerModel (its vision encoder separates from its LLM)
    source: Any  # this rank's StepSource (an LLM rank's packs, or an encoder rank's)
    microbatches: int
    precision: str = "fp32"
    bounds: list[int] = field(default_factory=list)  # pp > 1: the LLM's stages, [e, ..., n] (`llm_bounds`)
    schedule: str = "1f1b"  # pp > 1: the LLM's pipeline schedule (1f1b or gpipe)
    recompute: bool = False  # every layer of this rank recomputes its activations in backward (recompute.mode=all)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        first, n = separate_encoder_layers(self.model, "disaggregated"), len(self.model.kinds)
        mesh = self.mesh
        bounds = validate_partition(self.bounds or [first, n], n, mesh.pp, first)
        lo, hi = (0, first) if mesh.is_encoder else (bounds[mesh.stage], bounds[mesh.stage + 1])
        for i, layer in enumerate(self.model.layers):  # the other ranks' layers stay on the CPU, unused
            layer.to(mesh.device if lo <= i < hi else "cpu")
        autocast = autocast_dtype(self.precision)
        dtype = autocast or torch.float32
        self.module = StageModule(self.model.layers, lo, hi, [self.recompute] * (hi - lo), autocast, hi == n)
        encoder, stage = (self.module, None) if mesh.is_encoder else (None, self.module)
        pipeline = None
        if mesh.pp > 1:  # collective on CUDA (every rank makes the replicas' message groups)
            channel = Channel(mesh)
            if not mesh.is_encoder:
                pipeline = BubbleRunner(mesh, None, stage, self.model, bounds, self.microbatches, self.schedule,
                                        dtype, channel)
        self.step = EncoderRanksStep(self.mesh, encoder, stage, self.model, self.microbatches, dtype,
                                     pipeline=pipeline, schedule=self.schedule)
        self.meta = {"encoder_ranks": mesh.encoder_ranks, "encoder_layers": [0, first]}
        if mesh.pp > 1:
            self.meta["bounds"] = bounds

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def checkpoint_module(self) -> torch.nn.Module:
        """This side's layers under their index in the model (the other side's ranks save the rest)."""
        holder = torch.nn.Module()
        holder.layers = self.module.layers
        return holder

    def agree(self, batch: Microbatches | None) -> StepShape:
        """Every rank of both sides has the same step, or the run stops on all. The LLM ranks' shape (its loss
        tokens) is theirs, from their first stage; an encoder rank's packs hold no LLM side."""
        streams = self.source is not None  # every rank but the LLM's later stages
        position = (batch.shape.epoch, batch.shape.step) if batch is not None else (-1, -1)
        mine = torch.tensor([0 if streams and batch is None else 1, int(streams), *position], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.mesh.world)]
        dist.all_gather(everyone, mine)
        if not all(int(t[0]) for t in everyone):
            return StepShape(0, 0, 0, 0, stop=True)
        positions = {tuple(t[2:].tolist()) for t in everyone if int(t[1])}
        if len(positions) > 1:  # streams at different steps would pair images with the wrong packs
            raise RuntimeError(f"the ranks' streams stand at different steps {sorted(positions)}: every LLM and "
                               "encoder rank must stream the same job from the same position")
        if self.mesh.pp > 1 and not self.mesh.is_encoder:
            return share_step_shape(self.mesh, batch.shape if batch is not None else None)
        return batch.shape

    def train_step(self, shape: StepShape, batch: Microbatches | None) -> StepTally:
        losses = self.step.run(shape, batch)
        tally = StepTally(float(sum(loss.item() for loss in losses)), stats=dict(self.step.last_stats))
        mesh, m = self.mesh, self.microbatches
        if batch is None:  # an LLM rank's later stage: its loss only
            return tally
        if not mesh.is_encoder:
            tally.tokens, tally.padded_tokens = batch.real_tokens, shape.tokens * m
            tally.samples_by_dataset = batch.samples_by_dataset
            features = [features_of_carrier(batch.microbatch(k, m)) for k in range(m)]
            tally.rows["llm_microbatches"] = [(mesh.replica, k, f.tokens, f.tiles, f.square)
                                              for k, f in enumerate(features)]
        else:
            tally.tiles = tally.padded_tiles = sum(int(images.encode_input.shape[0]) for images in batch.routed)
            tally.rows["encoder_work"] = [(mesh.encoder_rank, consumer, k, units) for k, images in
                                          enumerate(batch.routed) for consumer, _, _, units in images.encoded]
        return tally

    def clip_gradients(self, max_norm: float) -> float:
        """The norm over the whole model: each part (replicated over its side's replicas) counted once, by the
        LLM's first replica (every stage) and encoder rank 0."""
        mesh = self.mesh
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=mesh.device)
        if mesh.encoder_rank == 0 if mesh.is_encoder else mesh.replica == 0:
            for grad in grads:
                squares += grad.detach().double().pow(2).sum()
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        if max_norm > 0 and norm > max_norm and grads:
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
        return norm

