"""The named choices of a plan (strategy, oversize policy, pixel mode, CP mode, staleness, ...): enums whose
members are their names on the wire, in files and on the command line (`packfeed.v1.options` uses them).

Part of the contract (`packfeed.v1`): pure Python.
"""

from __future__ import annotations

import enum


class _Named(str, enum.Enum):
    """An enum whose members are their names on the wire, in files and on the command line."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | _Named, what: str) -> _Named:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {', '.join(m.value for m in cls)}, not {value!r}") from None


class Strategy(_Named):
    """How samples become packs and packs become steps."""

    RANDOM = "random"  # baseline: random fixed-size batches, padded to their longest sample
    LENGTH_GROUP = "length-group"  # baseline: LLaVA's length-grouped batches, padded
    ISF = "isf"  # OmniBal's ISF packs, placed in random order (its published step formation)
    ISF_BALANCE = "isf+balance"  # ISF packs, balanced steps, LPT over ranks, 1F1B microbatch order
    # isf+balance with the LLM's ranks balanced on its own cost, and each step's encoder work assigned to ranks
    # apart, balanced on its own, its outputs routed to their packs' ranks (OrchMLLM; plan/phases.py)
    ISF_PHASES = "isf+phases"

    @property
    def padded(self) -> bool:
        """Fixed-size batches padded to their longest sample (no caps, no packing)."""
        return self in (Strategy.RANDOM, Strategy.LENGTH_GROUP)


class PixelMode(_Named):
    """Where and how a served dataset's images become tiles (its `pixels`; `JobInfo.pixels` on the wire)."""

    EXACT = "exact"  # on the server, Pillow's bicubic byte for byte: what the Hugging Face processors give
    FAST = "fast"  # on the server, within a stated bound of exact for a fraction of its CPU
    ENCODED = "encoded"  # the image files travel; the client decodes and cuts them


class CpMode(_Named):
    """How a context-parallel plan gives packs their degree (`context_parallel` > 1)."""

    # each pack over the fewest GPUs of its rank's CP group that hold it within max_tokens_per_gpu; short packs
    # run side by side on sub-groups (Megatron-Core's dynamic context parallelism, planned ahead)
    DYNAMIC = "dynamic"
    STATIC = "static"  # every pack over all C GPUs of the group (the usual CP): the baseline


class VisualKind(enum.IntEnum):
    """What a pack's visual item is (its `visual_kind` tensor on the wire: int32)."""

    IMAGE = 0
    VIDEO = 1  # its tiles are its sampled frames (or one temporal patch of them)


class Oversize(_Named):
    """What happens to a sample that alone exceeds a pack cap (always reported)."""

    ALONE = "alone"  # it travels as a pack of its own
    SKIP = "skip"  # it is dropped
    TRUNCATE = "truncate"  # its tokens are cut to the token cap (too many vision units still travel alone)


class Staleness(_Named):
    """What a live job does with samples older than `max_staleness` allows (docs/live.md "Asynchronous RL")."""

    DROP = "drop"  # a step drops them (and counts them)
    WAIT = "wait"  # producers reserve before generating and wait for a grant: none is generated too early to train
