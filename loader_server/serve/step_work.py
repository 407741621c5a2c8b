"""What a worker is given and what it gives back: a dataset's source, one rank-step's planned work, and the prepared
step, whose messages arrive in a shared-memory file (`step_files`) and are read as views of it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from packfeed.server.serve.step_files import SharedFiles, give_back_file, map_file
from packfeed.server.serve.wire import SplitMessage
from packfeed.v1.layout import Layout, Seat
from packfeed.v1.options import PixelMode


@dataclass(frozen=True)
class DatasetSource:
    """What a worker needs to read one dataset (server-side configuration only)."""

    index: str
    tokenizer: str
    shard_root: str | None = None
    pixels: PixelMode = PixelMode.EXACT  # how images become tiles


class StepReads(Protocol):
    """What a worker reads a rank-step's samples through, as the job's source says: per source a member's `sources`
    entry counts in, its rows (what the pack builder asks of a sample: its row, what it shares its prefix with,
    its bytes), the reader that loads it and the dataset name its packs carry; and what every pack of the source
    carries beside its samples, and whether a member's rows say what it shares its prefix with
    (`shared_prefixes`). An index's are its rows and shards (`IndexReads`); a live job's, its spooled samples
    with their prompts' images from the indexes (`packfeed.server.serve.live_reads.LiveReads`)."""

    @property
    def sources(self) -> int: ...

    @property
    def shared_prefixes(self) -> bool: ...

    def parts(self, open_index: Callable[[str], tuple[Any, Any]]) -> list[tuple[Any, Any, str]]:
        """(rows, reader, label) per source; `open_index(name)` opens (or gives back) an index's rows and reader."""
        ...

    def complete(self, pack) -> None:
        """Give a built pack what the source's packs carry beside their samples."""
        ...


@dataclass(frozen=True)
class IndexReads:
    """A step of indexed data: each member read from its index's rows and shards."""

    datasets: tuple[str, ...]  # the worker's names of the indexes a member's source counts in
    labels: tuple[str, ...]  # the dataset names the packs carry (`sample_sources`), one per index
    shared_prefixes: bool = False  # the plan shares its groups' prefixes (`PlanConfig.shares_prefixes`)

    @property
    def sources(self) -> int:
        return len(self.datasets)

    def parts(self, open_index: Callable[[str], tuple[Any, Any]]) -> list[tuple[Any, Any, str]]:
        return [(*open_index(name), label) for name, label in zip(self.datasets, self.labels)]

    def complete(self, pack) -> None:
        pass


@dataclass
class RankStepWork:
    reads: StepReads  # where the step's samples are read from (an index's shards, a live spool)
    epoch: int
    step: int
    # whose step: an LLM rank's, or (the encoder on ranks of its own, layout.encoder_ranks > 0) an encoder rank's,
    # with `packs` empty and `routed` what it encodes; every lane and replica of the rank is sent this work
    seat: Seat
    layout: Layout  # the job's degrees: with cp > 1 each pack goes out as cp shares, one per GPU of the CP group
    packs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per microbatch: (sample ids, token limits, sources)
    step_loss_tokens: int
    last_in_epoch: bool
    seed: int = 0  # the job's: random video frames are drawn from (seed, epoch, sample key)
    # isf+phases (`packfeed.server.serve.routed`), per microbatch: the rank encoding each member of the pack, and
    # what this rank encodes there (sample ids, sources, targets: consumer rank and planned position)
    routed: list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]] | None = None
    # bytes decoding one image or tokenising one sample may take (MemoryBudget.working_limit): a sample needing
    # more is skipped, with its reason, instead of prepared; 0: no limit
    decode_budget: int = 0
    # context parallelism (layout.cp C > 1), per microbatch: each member's CP degree and cp_group, for its C shares
    # (`packfeed.server.serve.cp_shares`)
    cp_spans: list[tuple[np.ndarray, np.ndarray]] | None = None

    def samples_by_source(self, pixels_only: bool = False) -> list[tuple[int, np.ndarray]]:
        """(source k, its sample ids) for each index the step reads, every pack's samples together: a step's
        per-index reads (budget estimates, tile bytes) read each column once per step, not once per pack.
        `pixels_only`: the samples whose images this rank reads (routed: those it encodes)."""
        groups = [(ids, sources) for ids, _, sources in self.packs] if not (pixels_only and self.routed) else []
        groups += [(ids, sources) for _, (ids, sources, _) in self.routed or ()]
        ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in groups] or [np.zeros(0, np.int64)])
        sources = np.concatenate([np.asarray(sources) for _, sources in groups] or [np.zeros(0, np.int32)])
        chosen = [(k, ids[sources == k]) for k in range(self.reads.sources)]
        return [(k, source_ids) for k, source_ids in chosen if len(source_ids)]


@dataclass
class RankStepResult:
    """A prepared rank-step. From a worker process the messages travel in a file in shared memory (`shared`,
    where each lies: its `segments`), not through pickling: `attach()` maps the file, and the messages are then
    views of the mapping; once the last of them is dropped the file goes back to the server's pool (`files`)
    to carry another step (without a pool it is removed)."""

    # serialized Pack, one per microbatch (with context parallelism, one per microbatch and GPU of the CP group:
    # message m * C + lane): bytes, or views of the attached mapping (SplitMessage)
    messages: list
    samples: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    by_dataset: dict[str, int] = field(default_factory=dict)  # samples delivered per dataset
    shared: str | None = None  # the file holding the messages, until attached
    segments: list[list[tuple[int, int]]] = field(default_factory=list)  # per message: (offset, bytes) in order
    files: "SharedFiles | None" = field(default=None, repr=False)  # the server's pool the file comes from
    cpu_seconds: float = 0.0  # the worker's CPU time preparing it (`loader_use`)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "files": None}  # the server's pool never travels to or from a worker

    def for_lane(self, lane: int, groups: int) -> list:
        """The messages GPU `lane` of a CP group of `groups` receives (all of them without context parallelism)."""
        return self.messages if groups == 1 else self.messages[lane::groups]

    @property
    def nbytes(self) -> int:
        if self.segments:
            return sum(length for spans in self.segments for _, length in spans)
        return sum(len(m) for m in self.messages)

    def attach(self) -> "RankStepResult":
        if self.shared is None:
            return self
        path, self.shared = self.shared, None
        end = max((offset + length for spans in self.segments for offset, length in spans), default=0)
        if not end:
            give_back_file(self.files, path)
            self.messages = [b"" for _ in self.segments]
            return self
        try:
            view = self.files.view(path, end) if self.files else np.frombuffer(map_file(path), np.uint8, end)
        except OSError:
            give_back_file(self.files, path)
            raise
        # once no message views it any more (the callback must not hold the result: it holds the views)
        weakref.finalize(view, give_back_file, self.files, path)
        views = [[memoryview(view[offset:offset + length]) for offset, length in spans] for spans in self.segments]
        self.messages = [spans[0] if len(spans) == 1 else SplitMessage(tuple(spans)) if spans else b""
                         for spans in views]
        return self

    def discard(self) -> None:
        """Give back the file of a result nobody will attach (its step was abandoned)."""
        if self.shared is not None:
            path, self.shared = self.shared, None
            give_back_file(self.files, path)
