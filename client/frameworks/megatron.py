"""Megatron-Core fed by Packfeed: each pack as Megatron's packed (THD) batch, each step as the data iterator of
one call of its pipeline schedule. `pip install packfeed[megatron]`.

    steps = MegatronSteps(PackStream("loader:50051", job="sft", rank=dp_rank, dp=dp, microbatches=M))
    forward_backward = get_forward_backward_func()
    for step in steps:
        forward_backward(forward_step_func=forward_step, data_iterator=step.data_iterator, model=model,
                         num_microbatches=step.num_microbatches, seq_length=step.seq_length, micro_batch_size=1)
        optimizer.step()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=packed_seq_params(batch))
        return output, functools.partial(loss_func, batch)

- A batch holds `tokens`, `labels` (each token's next token within its sample), `loss_mask` (1 where that next
  token is supervised), `position_ids` (restarting per sample), `cu_seqlens`, `cu_seqlens_padded` and
  `max_seqlen`, each with Megatron's leading batch dimension of 1: what its GPT datasets and
  `get_thd_batch_on_this_cp_rank` take. `pad_to_multiple` pads every sample to a multiple of it (context
  parallelism with THD needs 2 x CP: `pad_to_multiple=2 * cp_size`); padding is outside the loss.
- `loss_func` returns Megatron's 3-tuple (summed loss, loss tokens, report) for `calculate_per_token_loss=True`:
  Megatron then divides by the step's loss tokens over every DP rank, which is the global per-token mean
  Packfeed's plan counts (`step_loss_tokens`). Without it, `loss_func(..., per_token=False)` scales each
  microbatch's summed loss by M x dp / step_loss_tokens, undoing Megatron's division by the microbatches and
  its gradient average over DP.
- `MegatronSteps.state_dict()` / `load_state_dict()` are the stream's position: save it with each checkpoint
  (one per DP rank, as `packfeed train` does) and load it before the first step to continue at exactly the
  next one.
- Pipelines: Megatron reads the data iterator on the first and the last stage; give both a `MegatronSteps`
  over the same rank's packs (`PackStream(..., replica=k, replicas=2)`). Its schedules at pp > 1 send every
  microbatch's activations at one shape, `seq_length` tokens, unless `variable_seq_lengths=True` in the model's
  config (which sends each shape first): packs differ in length, so set it, or take
  `MegatronSteps(..., same_length=True)`, which pads every microbatch of a step to its longest at the end
  (the last sample's padded span grows; outside the loss).
- Vision: a pack's images are `images` (the raw tiles, `PackTensors.tiles()`) and `image_token_spans`, for
  the model's own vision encoder; Megatron's LLaVA model takes them its own way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from packfeed.client.stream.resume import ForwardsStreamState
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors, Step


def megatron_batch(pack: PackTensors, pad_to_multiple: int = 1, device: torch.device | str | None = None,
                   pad_to_length: int | None = None) -> dict[str, Any]:
    """One pack as Megatron's packed batch (see the module docstring). `pad_to_length`: the batch padded at its
    end to that many tokens (the last sample's padded span grows; outside the loss), for a pipeline that sends
    every microbatch's activations at one length."""
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, not {pad_to_multiple}")
    bounds = pack.cu_seqlens.to(torch.long).tolist()
    input_ids, labels, positions = (pack.input_ids.to(torch.long), pack.labels.to(torch.long),
                                    pack.position_ids.to(torch.long))
    pieces: dict[str, list[torch.Tensor]] = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    padded = [0]
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        width = _padded(length, pad_to_multiple)
        target = torch.zeros(width, dtype=torch.long)
        target[:length - 1] = input_ids[start + 1:end]  # each token predicts the next one of its own sample
        mask = torch.zeros(width, dtype=torch.float32)
        mask[:length - 1] = (labels[start + 1:end] != IGNORE_INDEX).float()
        pieces["tokens"].append(torch.cat([input_ids[start:end], torch.zeros(width - length, dtype=torch.long)]))
        pieces["labels"].append(target)
        pieces["loss_mask"].append(mask)
        pieces["position_ids"].append(torch.cat([positions[start:end], torch.arange(width - length) + length]))
        padded.append(padded[-1] + width)
    if pad_to_length is not None:
        _pad_tail(pieces, padded, bounds, pad_to_length)
    batch = {name: (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).unsqueeze(0)
             for name, parts in pieces.items()}
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    batch["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    batch["cu_seqlens_padded"] = torch.tensor(padded, dtype=torch.int32)
    batch["max_seqlen"] = torch.tensor([max(lengths, default=0)], dtype=torch.int32)
    batch["step_loss_tokens"] = int(pack.step_loss_tokens)
    if pack.tile_shapes.shape[0]:
        batch["images"] = pack.tiles()
        batch["image_token_spans"] = pack.image_token_spans.view(-1, 2)
    if device is not None:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def _padded(length: int, multiple: int) -> int:
    """A sample's tokens in the batch: its length rounded up to the multiple."""
    return -(-length // multiple) * multiple


def _pad_tail(pieces: dict[str, list[torch.Tensor]], padded: list[int], bounds: list[int], length: int) -> None:
    """Pad the batch's pieces to `length` tokens: the last sample's padded span grows (a pack with no sample
    gets an empty one)."""
    extra = length - padded[-1]
    if extra < 0:
        raise ValueError(f"pad_to_length {length} is shorter than the batch's {padded[-1]} tokens")
    if not extra:
        return
    if len(bounds) == 1:  # no sample: one of length 0, all padding
        bounds.append(bounds[0])
        padded.append(padded[-1])
    start = padded[-1] - padded[-2]  # positions continue the last span's padding
    pieces["tokens"].append(torch.zeros(extra, dtype=torch.long))
    pieces["labels"].append(torch.zeros(extra, dtype=torch.long))
    pieces["loss_mask"].append(torch.zeros(extra, dtype=torch.float32))
    pieces["position_ids"].append(torch.arange(extra) + start)
    padded[-1] += extra


def packed_seq_params(batch: dict[str, Any]):
    """Megatron-Core's `PackedSeqParams` (THD) of a batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(batch["max_seqlen"][0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch["cu_seqlens"], cu_seqlens_kv=batch["cu_seqlens"],
                           cu_seqlens_q_padded=batch["cu_seqlens_padded"],
                           cu_seqlens_kv_padded=batch["cu_seqlens_padded"], max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def loss_func(batch: dict[str, Any], output_tensor: torch.Tensor, per_token: bool = True,
              num_microbatches: int = 1, dp: int = 1):
    """Megatron's loss function over `output_tensor` (per-token losses, shaped like `tokens`). `per_token`: the
    3-tuple for `calculate_per_token_loss=True`; otherwise the summed loss scaled so that Megatron's division by
    `num_microbatches` and its average over `dp` leave the step's global per-token mean."""
    mask = batch["loss_mask"].view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}
    if per_token:
        return loss, tokens, report
    return loss * (num_microbatches * dp / max(batch["step_loss_tokens"], 1)), report


@dataclass
class MegatronStep:
    """One step's M microbatches for one call of Megatron's `forward_backward_func`."""

    epoch: int
    step: int
    batches: list[dict[str, Any]]
    sample_keys: list[list[str]] = field(default_factory=list)  # each microbatch's samples, in packing order

    @property
    def data_iterator(self) -> Iterator[dict[str, Any]]:
        return iter(self.batches)

    @property
    def num_microbatches(self) -> int:
        return len(self.batches)

    @property
    def seq_length(self) -> int:
        """The longest microbatch's tokens (Megatron sizes its pipeline messages from it)."""
        return max((int(b["tokens"].shape[1]) for b in self.batches), default=0)


class MegatronSteps(ForwardsStreamState):
    """A `PackStream`'s steps as `MegatronStep`s; its position is the stream's (`state_dict`)."""

    def __init__(self, stream, pad_to_multiple: int = 1, device: torch.device | str | None = None,
                 same_length: bool = False):
        self.stream, self.pad_to_multiple, self.device = stream, pad_to_multiple, device
        self.same_length = same_length  # every microbatch of a step padded to its longest: see the module docstring
        self._steps: Iterator[Step] | None = None

    def __iter__(self) -> MegatronSteps:
        return self

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._steps = None  # iterated again from the stream's restored position

    def __next__(self) -> MegatronStep:
        if self._steps is None:
            self._steps = iter(self.stream)
        step = next(self._steps)
        length = None
        if self.same_length:
            multiple = self.pad_to_multiple
            length = max((sum(_padded(n, multiple) for n in pack.cu_seqlens.diff().tolist())
                          for pack in step.packs), default=0)
        return MegatronStep(step.epoch, step.step, [megatron_batch(pack, self.pad_to_multiple, self.device, length)
                                                    for pack in step.packs],
                            [list(pack.sample_keys) for pack in step.packs])

