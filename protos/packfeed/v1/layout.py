"""A run's parallel layout and a consumer's seat in it: the one place that says which degrees combine (the plan,
the server and the trainer ask `Layout.problems()`) and where a stream's reader sits. Pure Python, part of the
contract beside `context_parallel.py`.

Names, one per quantity: `dp` data-parallel ranks, `pp` pipeline stages, `cp` the GPUs of one replica's
context-parallel group (C), `encoder_ranks` processes that run only the encoder (E). A seat's `lane` is one GPU of
a replica's CP group (0..cp-1); a pack's `degree` is how many GPUs it spans and its `cp_group` which aligned run
of them (plans, `context_parallel.py`); `share_rank` is a lane's place inside one pack (0..degree-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RunnerKind = Literal["whole", "pipeline", "context_parallel", "disaggregated"]
MAX_REPLICAS = 1024  # readers of one seat's packs (a TP x SP group beyond this is not a real deployment)


@dataclass(frozen=True)
class Layout:
    """How a run's processes divide: dp x pp x cp ranks train the LLM, `encoder_ranks` more run the encoder.
    Frozen; `problems()` says whether the degrees combine (it does not raise, so each caller words its refusal
    with its own field names around the same messages)."""

    dp: int
    pp: int = 1
    cp: int = 1
    encoder_ranks: int = 0

    def problems(self) -> list[str]:
        """Every rule of which layouts combine, each broken one as a sentence that says what to do."""
        if self.dp < 1 or self.pp < 1:
            return [f"dp {self.dp} and pp {self.pp}: each must be >= 1"]
        if self.cp < 1 or self.cp & (self.cp - 1):
            return [f"cp must be a power of 2 (1, 2, 4, ...), not {self.cp}"]
        if self.encoder_ranks < 0:
            return [f"encoder_ranks must be >= 0 (0: the encoder on the LLM's ranks), not {self.encoder_ranks}"]
        problems = []
        if self.cp > 1 and self.pp > 1:
            problems.append(f"context parallelism (cp {self.cp}) runs at pp 1, not pp {self.pp}: pipelines with "
                            "context parallelism are not supported yet")
        if self.cp > 1 and self.encoder_ranks:
            problems.append(f"encoder ranks ({self.encoder_ranks}) and context parallelism (cp {self.cp}) do not "
                            "combine yet: choose one")
        return problems

    def checked(self) -> Layout:
        """This layout, or ValueError naming every problem."""
        if problems := self.problems():
            raise ValueError("invalid layout: " + "; ".join(problems))
        return self

    @property
    def llm_ranks(self) -> int:
        return self.dp * self.pp * self.cp

    @property
    def world(self) -> int:
        """Every process of the run: the LLM's dp x pp x cp and the encoder's own."""
        return self.llm_ranks + self.encoder_ranks

    @property
    def runner(self) -> RunnerKind:
        """The kind of training step the layout needs (one runner each; `problems()` keeps them exclusive)."""
        if self.encoder_ranks:
            return "disaggregated"
        if self.cp > 1:
            return "context_parallel"
        return "pipeline" if self.pp > 1 else "whole"


@dataclass(frozen=True)
class Seat:
    """A consumer's place in a job: the rank it reads for (an encoder rank's number with `encoder`), its `lane`
    (the GPU of the rank's CP group whose share of each pack it receives) and its `replica` (one of several
    readers of identical packs: the ranks of a tensor or sequence parallel group)."""

    rank: int
    replica: int = 0
    lane: int = 0
    encoder: bool = False

    def problems(self, layout: Layout) -> list[str]:
        """Whether this seat exists in `layout`, as sentences that say what to do."""
        problems = []
        if self.encoder and not layout.encoder_ranks:
            problems.append("the job has no encoder ranks (its encoder_ranks is 0: the encoder runs on the LLM's "
                            "ranks): open it as an LLM rank")
        elif not self.within(layout):
            count, what = (layout.encoder_ranks, "encoder ranks") if self.encoder else (layout.dp, "ranks")
            problems.append(f"{self.name} is outside the job's {count} {what}")
        if self.encoder and self.lane:
            problems.append(f"lane {self.lane}: an encoder rank has no context-parallel lane; give lane 0")
        elif not 0 <= self.lane < layout.cp:
            problems.append(f"lane {self.lane} is outside the job's {layout.cp} context-parallel GPUs per rank (cp "
                            f"{layout.cp}); give 0 <= lane < {layout.cp}")
        if not 0 <= self.replica < MAX_REPLICAS:
            problems.append(f"replica {self.replica}: give 0 <= replica < {MAX_REPLICAS}")
        return problems

    def within(self, layout: Layout) -> bool:
        """Whether its rank is one of the layout's (an encoder rank's of its encoder ranks)."""
        return 0 <= self.rank < (layout.encoder_ranks if self.encoder else layout.dp)

    @property
    def primary(self) -> bool:
        """Its acknowledgements and skips count for its rank: the first lane and replica (the others read the same
        steps, and are answered without being counted). An encoder rank's count as reports; the LLM ranks' move
        the job."""
        return self.replica == 0 and self.lane == 0

    @property
    def name(self) -> str:
        """How messages and logs name it: "rank 3", "encoder rank 0", "rank 3 lane 1 replica 2"."""
        name = f"encoder rank {self.rank}" if self.encoder else f"rank {self.rank}"
        return name + (f" lane {self.lane}" if self.lane else "") + (f" replica {self.replica}" if self.replica else "")

    @property
    def lease_name(self) -> str:
        """The lease one server holds while it streams to this seat, unique within a job: an LLM rank's first
        seat keeps the rank's number (the key v1 servers use), the others add what tells them apart."""
        name = f"encoder-{self.rank}" if self.encoder else str(self.rank)
        return name + (f".lane-{self.lane}" if self.lane else "") + (f".replica-{self.replica}" if self.replica else "")
