"""The plan specification: the one definition of how a job's epochs are planned.

`PlanConfig` is what `packfeed plan/stats` build from their flags, what the trainer builds from its `data`
section, what `PackStream` sends, and what the server plans with; `to_proto` / `from_proto` convert it to and
from the wire's `PlanSpec` (unset fields there mean the defaults here). Strategy and oversize policy are
enums, checked when a config is made, so a bad name fails where it enters.

This module is part of the contract (`packfeed.v1`): pure Python, no numpy, importable by servers and clients.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from packfeed.v1.cost_model import CostModel
from packfeed.v1.layout import Layout

if TYPE_CHECKING:  # the messages are imported where converted: `packfeed plan` never pays for protobuf
    from packfeed.v1 import packfeed_pb2 as pb


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


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# proto3 `optional` where false is a choice, not "unset" (the counts with presence, microbatches,
# pipeline_stages and isf_iterations, take 0 as the default, as v1 clients sent it before they had presence)
_WITH_PRESENCE = ("collective_safe", "max_staleness", "shared_prefix")
LIVE_FIELDS = ("step_samples", "step_tokens", "max_staleness", "steps")  # a live job's (`live`) own settings

# Bounds of every count a request may carry: a server plans and holds state in proportion to them.
LIMITS = {"dp": 65536, "microbatches": 1024, "ranks_per_node": 65536, "pipeline_stages": 1024, "isf_iterations": 100,
          "samples_per_pack": 1024, "vision_cap": 2**31 - 1, "token_cap": 2**31 - 1, "vision_target": 2**31 - 1,
          "token_target": 2**31 - 1, "window": 2**40, "context_parallel": 1024, "max_tokens_per_gpu": 2**31 - 1,
          "encoder_ranks": 65536, "step_samples": 1 << 20, "step_tokens": 1 << 40, "max_staleness": 2**31 - 1,
          "steps": 1 << 40}
MAX_NAME = 256  # characters of a job id or dataset name
MAX_EPOCHS = 1_000_000  # of one job
MAX_RESUME_CHAIN = 16  # a job resuming a job that resumed another ...: each link re-plans an epoch at open


@dataclass(frozen=True)
class PlanConfig:
    """How a job's epochs are planned (the `help` of each field is the CLI's). Frozen: validated once, when made."""

    dp: int = field(default=8, metadata=_help("data-parallel ranks"))
    microbatches: int = field(default=1, metadata=_help("packs per rank per step, M"))
    pipeline_stages: int = field(default=1, metadata=_help("pipeline stages P, for the 1F1B microbatch order"))
    strategy: Strategy = field(default=Strategy.ISF_BALANCE, metadata=_help("how samples become packs and steps"))
    vision_cap: int | None = field(default=None, metadata=_help("max vision units per pack (automatic when omitted)"))
    token_cap: int | None = field(default=None, metadata=_help("max LLM tokens per pack (automatic when omitted)"))
    vision_target: int | None = field(default=None,
                                      metadata=_help("ISF keeps packs with at least this many vision units"))
    token_target: int | None = field(default=None,
                                     metadata=_help("... or at least this many tokens (default: token cap - 128)"))
    isf_iterations: int = field(default=10, metadata=_help("ISF sampling/filtering rounds"))
    samples_per_pack: float = field(default=4.0, metadata=_help(
        "average pack size the automatic caps aim for; batch size of the padded baselines"))
    oversize: Oversize = field(default=Oversize.ALONE, metadata=_help(
        "a sample larger than a cap: its own pack (alone), dropped (skip), or its tokens cut to the cap "
        "(truncate); always reported"))
    cost_model: CostModel = field(default_factory=CostModel.from_shapes, metadata=_help(
        "per-sample cost coefficients to balance on (e.g. `packfeed train`'s OUT/cost_model.json)"))
    ranks_per_node: int = field(default=8, metadata=_help(
        "ranks per node: isf+phases routes encoder outputs to keep bytes within nodes"))
    colocate_encoder: bool = field(default=False, metadata=_help(
        "isf+phases: the same packs, but every rank encodes its own packs' images (no all-to-all): the baseline "
        "for the routed encoder, and for trainers that cannot exchange encoder outputs"))
    window: int = field(default=0, metadata=_help(
        "plan the epoch in windows of this many samples (0: all at once): the first step within seconds at any "
        "size; each window's last step may be lighter"))
    context_parallel: int = field(default=1, metadata=_help(
        "context-parallel GPUs per DP rank, C (a power of 2): the job runs on dp x C GPUs and each pack gets a "
        "degree d in 1, 2, 4, ..., C (docs/planning.md)"))
    max_tokens_per_gpu: int | None = field(default=None, metadata=_help(
        "context parallelism: LLM tokens one GPU may hold of a microbatch, N (default: the token cap)"))
    cp_mode: CpMode = field(default=CpMode.DYNAMIC, metadata=_help(
        "context parallelism: each pack over the fewest GPUs that hold it (dynamic) or over all C (static)"))
    encoder_ranks: int = field(default=0, metadata=_help(
        "the vision encoder on E ranks of its own (0: on the LLM's ranks): each step's items balanced over the E "
        "encoder ranks on the encoder's cost, the packs over the dp LLM ranks on the LLM's, every output routed "
        "to its consumer (docs/planning.md)"))
    collective_safe: bool = field(default=True, metadata=_help(
        "in every step and microbatch, every DP rank's pack calls the same towers (images, videos, each further "
        "encoder) or none, so FSDP / ZeRO-3 with a tower wrapped apart never waits on a rank that skips it; what "
        "the data cannot align the summary counts (docs/training.md)"))
    shared_prefix: bool = field(default=True, metadata=_help(
        "samples in groups (an index's group column, a live job's groups) are planned with their prefix counted "
        "once: a group's members in one pack where they fit, its prompt and images computed once (false: each "
        "sample alone, as without groups; docs/planning.md \"Groups\")"))
    live: bool = field(default=False, metadata=_help(
        "samples come from producers while the job runs (`packfeed.client.Producer`, `packfeed put`), and a step "
        "forms when step_samples samples or step_tokens tokens have arrived (docs/live.md)"))
    step_samples: int = field(default=0, metadata=_help("live: a step forms when this many samples have arrived"))
    step_tokens: int = field(default=0, metadata=_help(
        "live: ... or when this many LLM tokens have arrived (whichever comes first)"))
    max_staleness: int | None = field(default=None, metadata=_help(
        "live: a sample whose policy_version is more than this many steps behind the step that would take it is "
        "dropped and counted (unset: none is)"))
    steps: int = field(default=0, metadata=_help(
        "live: the job ends after this many steps (0: when a producer ends it)"))

    def __post_init__(self):
        problems = []
        for name, kind in (("strategy", Strategy), ("oversize", Oversize), ("cp_mode", CpMode)):
            try:
                object.__setattr__(self, name, kind.parse(getattr(self, name), name))
            except ValueError as error:
                problems.append(str(error))
        if isinstance(self.cost_model, dict):
            object.__setattr__(self, "cost_model", CostModel.from_dict(self.cost_model))
        problems += self.layout.problems()  # dp, pipeline_stages, context_parallel and encoder_ranks together
        if self.microbatches < 1:
            problems.append("microbatches must be >= 1")
        if self.window < 0:
            problems.append("window must be >= 0 (0: the whole epoch at once)")
        if self.ranks_per_node < 1:
            problems.append("ranks_per_node must be >= 1")
        if self.colocate_encoder and self.strategy is not Strategy.ISF_PHASES:
            problems.append("colocate_encoder applies to strategy isf+phases only (the others always colocate)")
        if self.isf_iterations < 1:
            problems.append("isf_iterations must be >= 1")
        if not self.samples_per_pack >= 1:  # NaN fails too
            problems.append("samples_per_pack must be >= 1")
        problems += [f"{name} must be <= {limit}" for name, limit in LIMITS.items()
                     if getattr(self, name) is not None and getattr(self, name) > limit]
        problems += self._context_parallel_problems()
        problems += self._encoder_ranks_problems()
        problems += self._live_problems()
        if (self.vision_cap is None) != (self.token_cap is None):
            problems.append("give both vision_cap and token_cap, or neither (automatic)")
        if any(v is not None and v < 1 for v in (self.vision_cap, self.token_cap)):
            problems.append("vision_cap and token_cap must be >= 1")
        if problems:
            raise ValueError("invalid plan config: " + "; ".join(problems))

    def _context_parallel_problems(self) -> list[str]:
        c = self.context_parallel
        if c > 1 and self.strategy not in (Strategy.ISF, Strategy.ISF_BALANCE):
            return [f"context_parallel plans ISF packs: strategy isf+balance or isf, not {self.strategy.value}"]
        if c > 1 and self.window:
            return ["context_parallel plans whole epochs: leave window at 0"]
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            return ["max_tokens_per_gpu must be >= 1"]
        if c == 1 and (self.max_tokens_per_gpu is not None or self.cp_mode is not CpMode.DYNAMIC):
            return ["max_tokens_per_gpu and cp_mode apply with context_parallel > 1"]
        return []

    def _encoder_ranks_problems(self) -> list[str]:
        if self.encoder_ranks <= 0:
            return []
        if self.strategy not in (Strategy.ISF, Strategy.ISF_BALANCE, Strategy.ISF_PHASES):
            return [f"encoder_ranks plans ISF packs: strategy isf+balance, isf or isf+phases, not "
                    f"{self.strategy.value}"]
        if self.colocate_encoder:
            return ["colocate_encoder encodes on the LLM's ranks: leave encoder_ranks at 0"]
        return []

    def _live_problems(self) -> list[str]:
        given = [name for name in LIVE_FIELDS if getattr(self, name) not in (None, 0)]
        if not self.live:
            return [f"{', '.join(given)} apply to live jobs only: set live"] if given else []
        problems = []
        if not (self.step_samples or self.step_tokens):
            problems.append("a live job needs step_samples or step_tokens (when a step forms)")
        if min(self.step_samples, self.step_tokens, self.steps, self.max_staleness or 0) < 0:
            problems.append("step_samples, step_tokens, steps and max_staleness must be >= 0")
        if self.window:
            problems.append("a live job plans each step as it forms: leave window at 0")
        if self.strategy.padded:
            problems.append(f"a live job plans ISF packs: strategy isf+balance or isf, not {self.strategy.value}")
        if self.strategy is Strategy.ISF_PHASES or self.encoder_ranks:
            problems.append("a live job encodes images where they train: strategy isf+balance or isf, "
                            "encoder_ranks 0")
        return problems

    @property
    def layout(self) -> Layout:
        """The run's degrees as one value (`packfeed.v1.layout`): dp, pipeline_stages, context_parallel and
        encoder_ranks."""
        return Layout(self.dp, self.pipeline_stages, self.context_parallel, self.encoder_ranks)

    @property
    def disaggregated(self) -> bool:
        """The encoder on ranks of its own (encoder_ranks > 0)."""
        return self.encoder_ranks > 0

    @property
    def slots(self) -> int:
        """Packs per global step: dp x microbatches."""
        return self.dp * self.microbatches

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as their names): what plan files, fingerprints and job descriptions record."""
        out = asdict(self)
        out["strategy"], out["oversize"], out["cp_mode"] = self.strategy.value, self.oversize.value, self.cp_mode.value
        out["cost_model"] = self.cost_model.to_dict()
        if not self.window:
            del out["window"]  # whole-epoch plans record what they recorded before windows existed
        if self.strategy is not Strategy.ISF_PHASES:
            del out["ranks_per_node"]  # ... and plans of the other strategies, what they did before phases
        if not self.colocate_encoder:
            del out["colocate_encoder"]
        if self.context_parallel == 1:  # plans without CP record what they did before it existed
            for name in ("context_parallel", "max_tokens_per_gpu", "cp_mode"):
                del out[name]
        if not self.encoder_ranks:  # ... and plans with the encoder on the LLM's ranks
            del out["encoder_ranks"]
        for name in ("collective_safe", "shared_prefix"):  # defaults: recorded when turned off
            if out[name]:
                del out[name]
        if not self.live:  # plans of indexed data record what they did before live jobs existed
            for name in ("live", *LIVE_FIELDS):
                del out[name]
        elif self.max_staleness is None:
            del out["max_staleness"]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PlanConfig:
        return cls(**raw)

    def to_proto(self) -> pb.PlanSpec:
        from packfeed.v1 import packfeed_pb2 as pb

        spec = pb.PlanSpec(**{name: value or 0 for name, value in self.to_dict().items() if name != "cost_model"})
        if self.cost_model != CostModel.from_shapes():
            spec.cost_model.CopyFrom(self.cost_model.to_proto())
        return spec

    @classmethod
    def from_proto(cls, spec: pb.PlanSpec) -> PlanConfig:
        """Unset (zero or empty) fields keep the defaults, but for `dp`, which a request must state, and
        `collective_safe` and `shared_prefix`, whose false is a choice. An explicit 0 of a count (`microbatches: 0`) is the default,
        as it was before those counts had presence: v1 clients written then still send it (protos/README.md,
        "Changes"). Raises ValueError on a bad config."""
        if not spec.dp:
            raise ValueError("invalid plan config: dp (data-parallel ranks) is required")
        chosen: dict[str, Any] = {f.name: getattr(spec, f.name) for f in fields(cls) if f.name != "cost_model"}
        chosen = {name: value for name, value in chosen.items()
                  if value or (name in _WITH_PRESENCE and spec.HasField(name))}
        if spec.HasField("cost_model"):
            chosen["cost_model"] = CostModel.from_proto(spec.cost_model)
        return cls(**chosen)
