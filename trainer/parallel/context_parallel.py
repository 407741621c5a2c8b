"""Context parallelism for the reference VLM (parallel.cp = C > 1, at pp 1), as a `StepRunner`.

Each DP replica is C GPUs. The plan (context_parallel C) gives every microbatch's GPUs their shares: a pack at
degree d runs on d aligned GPUs of the replica (`Mesh.cp_communicators[d, g]`), each holding two zigzag chunks of every
sample (`packfeed.v1.context_parallel`) and encoding its pieces of the pack's images (`cp_pieces`: the d GPUs
share the tiles, a long video's frames too). Per pack, on its d GPUs:

1. each encodes its pieces (vision layers), and an all-gather over the d GPUs gives every one all the pack's
   image features, from which it takes those of its own placeholder tokens;
2. every LLM block's attention all-gathers K and V over the d GPUs and attends each local query to the keys of
   its own sample at or before it in the unsplit sample (its position there, from the chunks), so the outputs
   equal the unsplit pack's;
3. the loss of each local token predicts the next token of the unsplit sample (labels gathered once per pack),
   normalised over the whole global step.

The all-gathers are autograd functions (their backward sums the gradients back to their owners). Packs at d = 1
run as without context parallelism. After the step's packs, one all-reduce sums every gradient over all ranks
(each GPU's are partial sums of its pack's), so every rank holds the gradient of the step's mean token loss:
exactly what one GPU computes on the unsplit packs (tested within 1e-5). A GPU with nothing in a microbatch
(a lane the plan leaves free in the last step) runs nothing there.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packfeed.client.model.attention import flash_varlen_attention
from packfeed.client.model.context_parallel import share_layout
from packfeed.client.stream.tensors import Step
from packfeed.trainer.batch import StepShape
from packfeed.trainer.models.reference import IGNORE_INDEX, LLMBlock, next_token_targets, packed_causal_attention
from packfeed.trainer.models.reference_inputs import pack_tiles
from packfeed.trainer.parallel.data_parallel import all_reduce_gradients
from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.pipeline import autocast_dtype, clip_gradients
from packfeed.trainer.parallel.runner import StepTally, agree_on_step
from packfeed.v1.context_parallel import pack_shares, rank_chunks


@dataclass
class ShareLayout:
    """Where one share's tokens sit in its pack, for every GPU of the pack (computed alike on each, no messages)."""

    degree: int
    share_rank: int  # this GPU's place within the pack (0..d-1)
    group: dist.ProcessGroup | None
    local_unsplit: torch.Tensor  # (local tokens,) each one's index in the unsplit pack
    rows: torch.Tensor  # (pack tokens,) row of each unsplit token in the gathered (degree x most) rows
    most: int  # the most tokens any GPU of the pack holds
    bounds: list[int]  # the unsplit samples' boundaries
    local_bounds: list[int]

    @classmethod
    def of(cls, pack, groups: dict) -> "ShareLayout":
        d, g, j = share_layout(pack)
        return cls.split(pack.cp_seqlens.long().tolist(), d, j, groups.get((d, g)) if d > 1 else None,
                         pack.cu_seqlens.long().tolist())

    @classmethod
    def split(cls, bounds: list[int], d: int, j: int, group, local_bounds: list[int]) -> "ShareLayout":
        """share rank j's share of the pack whose samples end at `bounds`, split over d GPUs; `local_bounds`: the
        share's own sample boundaries (its cu_seqlens)."""
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        held = []  # per share rank: the unsplit index of each token it holds, in its order
        for rank in range(d):
            parts = [torch.arange(start + a, start + b) for start, chunks in zip(bounds, pack_shares(lengths, d))
                     for a, b in rank_chunks(chunks, rank)]
            held.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
        most = max(len(h) for h in held)
        rows = torch.empty(bounds[-1], dtype=torch.int64)
        for rank, h in enumerate(held):
            rows[h] = rank * most + torch.arange(len(h))
        return cls(d, j, group, held[j], rows, most, bounds, local_bounds)

    def gather(self, local: torch.Tensor, most: int | None = None) -> torch.Tensor:
        """Every GPU's `local` rows (padded to `most`, default the most tokens), concatenated in share rank order;
        differentiable (the gradient of each row goes back to its owner)."""
        most = self.most if most is None else most
        padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, most - local.shape[0]))
        return GatherFromGroup.apply(padded, self.group, self.degree)

    @functools.cached_property
    def chunk_spans(self) -> list[tuple[int, int, int, int]]:
        """Per run of local tokens contiguous in the unsplit pack (a chunk, or two adjacent ones of a sample): its
        rows among the local tokens and the keys it sees in the unsplit pack (its sample's first token up to its
        own last)."""
        local = self.local_unsplit
        if len(local) == 0:
            return []
        cuts = set(self.local_bounds[:-1]) | set((torch.nonzero(local[1:] != local[:-1] + 1).flatten() + 1).tolist())
        rows = sorted(c for c in cuts if c < len(local)) + [len(local)]
        starts = torch.tensor(self.bounds)
        spans = []
        for row, end in zip(rows[:-1], rows[1:]):
            sample = int(torch.searchsorted(starts, local[row], right=True)) - 1
            spans.append((row, end, self.bounds[sample], int(local[end - 1]) + 1))
        return spans

    @functools.cached_property
    def span_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk spans as one variable-length attention: the local rows' bounds per span, the gathered rows
        (`gather`) of the keys each span sees (concatenated, a sample's first keys repeated for each of its spans)
        and their bounds."""
        spans = self.chunk_spans
        cu_q = torch.tensor([0] + [last for _, last, _, _ in spans], dtype=torch.int32)
        keys = self.rows[torch.cat([torch.arange(start, stop) for _, _, start, stop in spans])]
        cu_k = torch.tensor([0] + [stop - start for _, _, start, stop in spans], dtype=torch.int32).cumsum(0)
        return cu_q, keys, cu_k.to(torch.int32)


class GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0 over a group (every rank's tensor of one shape, in group rank order); the backward
    hands each rank the sum of every rank's gradient of its rows (reduce-scatter on NCCL; an all-reduce of the
    whole gradient elsewhere: gloo has no reduce-scatter, and torch's autograd all_gather mistakes a sub-group's
    ranks for global ones there)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        else:
            summed = grad.clone()
            dist.all_reduce(summed, group=ctx.group)
            mine = summed.chunk(ctx.size)[dist.get_rank(ctx.group)]
        return mine, None, None


class ContextParallelAttention:
    """The LLM blocks' attention while a pack at degree > 1 runs: K and V of the whole pack, gathered."""

    def __init__(self):
        self.layout: ShareLayout | None = None

    def __call__(self, q, k, v, cu_seqlens, scale: float | None = None):
        """q: (L, heads, dim); k, v: (L, heads or fewer key/value heads, dim), as this GPU holds them."""
        layout = self.layout
        if layout is None or layout.degree == 1:
            return packed_causal_attention(q, k, v, cu_seqlens)
        kv = layout.gather(torch.cat([k, v], dim=-1))  # every GPU's rows of the pack (grouped K/V heads: fewer bytes)
        if layout.chunk_spans and q.device.type == "cuda":  # one flash-attention call for every chunk
            cu_q, rows, cu_k = layout.span_keys
            flash = flash_varlen_attention(q, *_key_values(kv[rows.to(q.device)], q.shape[1]), cu_q, cu_k,
                                           causal=True, scale=scale)
            if flash is not None:
                return flash
        # imported here, not at the top: the module imports torch._dynamo (1.4 s of CPU), which a trainer without
        # DDP (pipelines, CP) otherwise never loads
        from torch.nn.attention.bias import causal_lower_right

        keys, values = _key_values(kv[layout.rows.to(q.device)], q.shape[1])
        out = torch.empty_like(q)
        for first, last, start, stop in layout.chunk_spans:
            # the chunk's queries are the last of keys [start, stop): causal aligned lower right, which the
            # flash and memory-efficient kernels take without a mask tensor
            out[first:last] = F.scaled_dot_product_attention(
                q[first:last].transpose(0, 1), keys[start:stop].transpose(0, 1), values[start:stop].transpose(0, 1),
                attn_mask=causal_lower_right(last - first, stop - start), scale=scale).transpose(0, 1)
        return out


def _key_values(kv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of K and V concatenated along the last dimension, each key/value head repeated for the
    query heads it serves (grouped-query attention)."""
    keys, values = kv.chunk(2, dim=-1)
    if keys.shape[1] != heads:
        keys, values = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (keys, values))
    return keys, values


class ContextParallelRunner:
    """A `StepRunner`: the reference VLM replicated on every rank, each pack of the plan split over its GPUs."""

    def __init__(self, model, mesh: Mesh, source, precision: str = "fp32"):
        if mesh.pp != 1:
            raise ValueError("context parallelism runs at parallel.pp=1")
        self.mesh, self.source, self.model, self.precision = mesh, source, model, precision
        self.layers = model.layers.to(mesh.device)
        self.text_embed = model.kinds.index("text_embed")
        self.attention = ContextParallelAttention()
        for layer in self.layers:
            if isinstance(layer, LLMBlock):
                layer.attention = self.attention  # context parallelism applied to the model, not written into it
        self.meta = {"context_parallel": mesh.cp}

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.layers.parameters())

    def checkpoint_module(self) -> torch.nn.Module:
        return self.layers

    def agree(self, step: Step | None) -> StepShape:
        return agree_on_step(step, self.mesh)

    def train_step(self, shape: StepShape, step: Step) -> StepTally:
        loss_sum, tokens, tiles, packs = 0.0, 0, 0, []
        for pack in step.packs:
            if pack.empty:
                continue
            packs.append(self._pack_row(pack))
            with self._autocast():
                loss = self.pack_loss(pack) / max(1, pack.step_loss_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
            tokens, tiles = tokens + int(pack.input_ids.numel()), tiles + int(pack.tile_shapes.view(-1, 3).shape[0])
        self.attention.layout = None
        if self.mesh.world > 1:  # each rank's gradients are partial sums of its packs and its replica's
            all_reduce_gradients(self.parameters(), None, 1.0)
        return StepTally(loss_sum, tokens=tokens, padded_tokens=tokens, tiles=tiles, padded_tiles=tiles,
                         samples_by_dataset=dict(Counter(step.sample_sources)) if self.mesh.lane == 0 else {},
                         packs=packs)

    def _pack_row(self, pack) -> tuple:
        """(replica, microbatch, degree, cp_group, tokens, tiles, sum of squared sample lengths) of a whole pack,
        the same on each of its GPUs."""
        d, g = share_layout(pack)[:2] if "cp" in pack.tensors else (1, self.mesh.lane)
        bounds = (pack.cp_seqlens if "cp" in pack.tensors else pack.cu_seqlens).long()
        lengths = bounds[1:] - bounds[:-1]
        return (self.mesh.replica, int(pack.microbatch), d, g, int(bounds[-1]), self.vision_units(pack),
                int((lengths ** 2).sum()))

    def vision_units(self, pack) -> int:
        """The whole pack's vision tiles (what the simulator's load rows count)."""
        return int(pack.image_token_spans.view(-1, 2)[:, 1].sum()) // self.model.config.tokens_per_tile

    def pack_loss(self, pack) -> torch.Tensor:
        """The summed next-token loss of this GPU's share of `pack` (a whole pack when it has no `cp`)."""
        device = self.mesh.device
        layout = ShareLayout.of(pack, self.mesh.cp_communicators) if "cp" in pack.tensors else None
        self.attention.layout = layout
        features = self._item_features(pack, layout)
        spans = pack.image_token_spans.view(-1, 2).long()
        vision_positions = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in spans.tolist()]) \
            if len(spans) else torch.zeros(0, dtype=torch.int64)
        labels = pack.labels.long().to(device)
        if layout is not None and layout.degree > 1:
            vision_positions, targets = self._local_positions(vision_positions, layout), self._targets(labels, layout)
        else:  # a whole pack, or one at degree 1: its spans index its own tokens
            targets = next_token_targets(labels, pack.cu_seqlens.long().to(device))
        return self.language_loss(pack, features, vision_positions.to(device), targets.to(device))

    def language_loss(self, pack, features: torch.Tensor, vision_positions: torch.Tensor,
                      targets: torch.Tensor) -> torch.Tensor:
        """The LLM's summed loss of this GPU's tokens: `features` (every item's, in item order) placed at
        `vision_positions` (a local row each, -1 where another GPU holds the token), predicting `targets`."""
        device = self.mesh.device
        carrier = (features, pack.input_ids.long().to(device), pack.position_ids.long().to(device),
                   pack.cu_seqlens.long().to(device), vision_positions, pack.labels.long().to(device))
        carrier = self.layers[self.text_embed](*carrier)
        for layer in self.layers[self.text_embed + 1:-1]:
            carrier = layer(*carrier)
        return self.layers[-1].loss(carrier[0], targets)

    def _item_features(self, pack, layout: ShareLayout | None) -> torch.Tensor:
        """(vision tokens of all the pack's items, in item order, D): each piece (a run of an item's tiles, or of a
        video's temporal patches) encoded by the GPU of the pack its `cp_pieces` row names, gathered."""
        features = self.encode_own(pack)
        if layout is None or layout.degree == 1:
            return features
        pieces = pack.cp_pieces.view(-1, 5)[:, 3:].long().tolist()  # (tokens, encoding rank), in item order
        counts = [sum(n for n, rank in pieces if rank == r) for r in range(layout.degree)]
        if max(counts) == 0:
            return features
        most = max(counts)
        gathered = layout.gather(features, most)  # (degree x most tokens, D)
        order, taken = [], [0] * layout.degree  # each piece's rows in the gathered ones, piece by piece
        for n, rank in pieces:
            order.extend(range(rank * most + taken[rank], rank * most + taken[rank] + n))
            taken[rank] += n
        return gathered[torch.tensor(order, dtype=torch.int64, device=features.device)]

    def encode_own(self, pack) -> torch.Tensor:
        """(vision tokens, D) of the pieces whose tiles this GPU holds, in item order."""
        tiles = pack_tiles(pack, self.model.config).to(self.mesh.device)
        if tiles.shape[0] == 0:
            return self.no_features()
        carrier = self.model.encoder_carrier(tiles)
        for layer in self.layers[:self.text_embed]:
            carrier = layer(*carrier)
        features = self.model.encoder_output(carrier)
        return features.reshape(-1, features.shape[-1])

    def no_features(self) -> torch.Tensor:
        # requires grad: every GPU of a pack must run the backward of the gather its features join
        width = self.layers[self.text_embed].embed.embedding_dim
        return torch.zeros(0, width, device=self.mesh.device, requires_grad=True)

    @staticmethod
    def _local_positions(vision_positions: torch.Tensor, layout: ShareLayout) -> torch.Tensor:
        """Each vision token's local row (spans index the unsplit pack), -1 where another GPU holds it."""
        local = torch.full((layout.bounds[-1],), -1, dtype=torch.int64)
        local[layout.local_unsplit] = torch.arange(len(layout.local_unsplit))
        return local[vision_positions]

    @staticmethod
    def _targets(labels: torch.Tensor, layout: ShareLayout) -> torch.Tensor:
        """Each local token's target: the next label of its unsplit sample (labels gathered from the pack's GPUs)."""
        unsplit = _gather_plain(labels, layout)[layout.rows.to(labels.device)]
        targets = next_token_targets(unsplit, torch.tensor(layout.bounds, device=labels.device))
        return targets[layout.local_unsplit.to(labels.device)]

    def _autocast(self):
        dtype = autocast_dtype(self.precision)
        return torch.autocast(self.mesh.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def clip_gradients(self, max_norm: float) -> float:
        return clip_gradients(self.parameters(), self.mesh, max_norm)



def _gather_plain(values: torch.Tensor, layout: ShareLayout) -> torch.Tensor:
    """Every GPU of the pack's `values` (1-D, padded to the most tokens), in share rank order; no gradient."""
    padded = F.pad(values, (0, layout.most - len(values)), value=IGNORE_INDEX)
    parts = [torch.empty_like(padded) for _ in range(layout.degree)]
    dist.all_gather(parts, padded, group=layout.group)
    return torch.cat(parts)
