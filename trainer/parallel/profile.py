"""Measure each layer on representative microbatches: forward and backward time, the size of the activations
it hands to the next layer (what a stage boundary after it would send), and the bytes autograd keeps for its
backward with and without recomputation. Partition search and the recompute chooser work from this table.

Memory is measured, not modelled: `SavedBytes` counts the distinct tensor storages autograd saves for
backward (parameters excluded) and releases them when autograd drops them, so its peak is the activation
memory a step holds — on CPU, where torch keeps no allocator statistics, this is the measured allocation.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class SavedBytes:
    """Context manager: live and peak bytes of tensors saved for backward (each storage counted once)."""

    def __init__(self, exclude: list[torch.Tensor] | tuple = ()):
        # FSDP2's weights are DTensors: their storage is this rank's shard
        self.exclude = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in exclude}
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.exclude or storage.nbytes() == 0 or isinstance(tensor, torch.nn.Parameter):
            return tensor  # weights (FSDP2's gathered ones too) are counted as weights, not activations
        holder = _Held(tensor)
        entry = self._refs.setdefault(pointer, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(holder, self._release, pointer)
        return holder

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, pointer: int) -> None:
        entry = self._refs[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[pointer]

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@dataclass
class LayerProfile:
    kind: str
    forward_s: float
    backward_s: float
    params: int
    output_bytes: int  # float activations this layer hands on: a boundary after it sends this much
    saved_bytes: int  # kept for backward without recomputation
    saved_bytes_recompute: int  # kept with this layer recomputed (its inputs only)
    per_microbatch: list[tuple[float, float]] = field(default_factory=list)  # (forward_s, backward_s) each

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict:
        return asdict(self)


def carrier_bytes(carrier: tuple[torch.Tensor, ...]) -> int:
    """Bytes a stage boundary sends: every tensor of the carrier (activations and the metadata riding along)."""
    return sum(t.numel() * t.element_size() for t in carrier)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _detached(carrier: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in carrier)


def _float_outputs(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t for t in outputs if t.is_floating_point() and t.requires_grad]


def profile_layers(layers: nn.ModuleList, kinds: list[str], microbatches: list[tuple[torch.Tensor, ...]],
                   device: torch.device, repeats: int = 1) -> list[LayerProfile]:
    """Run every microbatch through the layers one at a time, `repeats` measured passes after one warm-up pass
    (repeats=0: the single pass is measured). Figures are means per microbatch."""
    n = len(layers)
    forward, backward = [0.0] * n, [0.0] * n
    output_bytes, saved, saved_recompute = [0] * n, [0] * n, [0] * n
    per_microbatch: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    timed = 0
    for round_ in range(repeats + 1):
        for carrier in microbatches:
            carrier = tuple(t.to(device) for t in carrier)
            for i, layer in enumerate(layers):
                inputs = _detached(carrier)
                params = list(layer.parameters())
                with SavedBytes(params) as kept:
                    synchronize(device)
                    started = time.perf_counter()
                    outputs = layer(*inputs)
                    synchronize(device)
                    elapsed_forward = time.perf_counter() - started
                with SavedBytes(params) as kept_recompute:
                    recomputed = checkpoint(layer, *inputs, use_reentrant=False)
                del recomputed
                grads = [torch.ones_like(t) for t in _float_outputs(outputs)]
                synchronize(device)
                started = time.perf_counter()
                if grads:
                    torch.autograd.backward(_float_outputs(outputs), grads)
                synchronize(device)
                elapsed_backward = time.perf_counter() - started
                if round_ > 0 or repeats == 0:
                    forward[i] += elapsed_forward
                    backward[i] += elapsed_backward
                    per_microbatch[i].append((elapsed_forward, elapsed_backward))
                    output_bytes[i] += carrier_bytes(outputs)
                    saved[i] += kept.peak
                    saved_recompute[i] += kept_recompute.peak
                carrier = tuple(t.detach() for t in outputs)
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            if round_ > 0 or repeats == 0:
                timed += 1
        if repeats == 0:
            break
    timed = max(timed, 1)
    return [LayerProfile(kinds[i], forward[i] / timed, backward[i] / timed,
                         sum(p.numel() for p in layers[i].parameters()), output_bytes[i] // timed,
                         saved[i] // timed, saved_recompute[i] // timed, per_microbatch[i]) for i in range(n)]
