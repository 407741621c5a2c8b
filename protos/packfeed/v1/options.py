"""The plan specification: the one definition of how a job's epochs are planned.

`PlanConfig` is what `packfeed plan/stats` build from their flags, what the trainer builds from its `data`
section, what `PackStream` sends, and what the server plans with; `to_proto` / `from_proto` convert it to and
from the wire's `PlanSpec` (unset fields there mean the defaults here). Strategy and oversize policy are
enums, checked when a config is made, so a bad name fails where it enters.

This module is part of the contract (`packfeed.v1`): pure Python, no numpy, importable by servers and clients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from packfeed.v1.cost_model import CostModel
from packfeed.v1.layout import Layout
from packfeed.v1.plan_features import FEATURES, LIVE_FIELDS, PREFIX_SHARING_REFUSES
from packfeed.v1.plan_kinds import CpMode, Oversize, PixelMode, Staleness, Strategy, VisualKind

__all__ = ["FEATURES", "LIMITS", "LIVE_FIELDS", "MAX_EPOCHS", "MAX_NAME", "MAX_RESUME_CHAIN", "CostModel", "CpMode",
           "Oversize", "PixelMode", "PlanConfig", "Staleness", "Strategy", "VisualKind"]  # the kinds' and features' homes: their
# own modules; here, as plans name them

if TYPE_CHECKING:  # the messages are imported where converted: `packfeed plan` never pays for protobuf
    from packfeed.v1 import packfeed_pb2 as pb


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# proto3 `optional` where false is a choice, not "unset" (the counts with presence, microbatches,
# pipeline_stages and isf_iterations, take 0 as the default, as v1 clients sent it before they had presence)
_WITH_PRESENCE = ("collective_safe", "max_staleness", "shared_prefix")

# Bounds of every count a request may carry: a server plans and holds state in proportion to them.
LIMITS = {"dp": 65536, "microbatches": 1024, "ranks_per_node": 65536, "pipeline_stages": 1024, "isf_iterations": 100,
          "samples_per_pack": 1024, "vision_cap": 2**31 - 1, "token_cap": 2**31 - 1, "vision_target": 2**31 - 1,
          "token_target": 2**31 - 1, "window": 2**40, "context_parallel": 1024, "max_tokens_per_gpu": 2**31 - 1,
          "encoder_ranks": 65536, "step_samples": 1 << 20, "step_tokens": 1 << 40, "max_staleness": 2**31 - 1,
          "steps": 1 << 40, "group_size": 65536, "producer_timeout_s": 1e7, "group_timeout_s": 1e7}
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
    staleness: Staleness = field(default=Staleness.DROP, metadata=_help(
        "live: samples older than max_staleness allows are dropped (drop), or never generated: producers reserve "
        "before generating and wait for a grant (wait; docs/live.md \"Asynchronous RL\")"))
    producer_timeout_s: float = field(default=0.0, metadata=_help(
        "live: a stream waiting for a step fails, naming the job and its producers, once no sample was put for this "
        "long (0: it waits)"))
    group_size: int = field(default=0, metadata=_help(
        "live: a step takes a group whole, its G samples (or what arrived within group_timeout_s; 0: groups are "
        "not waited for)"))
    group_timeout_s: float = field(default=0.0, metadata=_help(
        "live: a group is taken with what arrived this long after its first sample (0: only whole)"))
    filter_groups: str = field(default="", metadata=_help(
        "live: the name of a per-sample value (e.g. reward); a whole group whose values are all equal is dropped "
        "and counted (DAPO's dynamic sampling)"))

    def __post_init__(self):
        problems = []
        for name, kind in (("strategy", Strategy), ("oversize", Oversize), ("cp_mode", CpMode),
                           ("staleness", Staleness)):
            try:
                object.__setattr__(self, name, kind.parse(getattr(self, name), name))
            except ValueError as error:
                problems.append(str(error))
        if isinstance(self.cost_model, dict):
            object.__setattr__(self, "cost_model", CostModel.from_dict(self.cost_model))
        problems += self.layout.problems()  # dp, pipeline_stages, context_parallel and encoder_ranks together
        if self.microbatches < 1:
            problems.append("microbatches must be >= 1")
        if self.ranks_per_node < 1:
            problems.append("ranks_per_node must be >= 1")
        if self.isf_iterations < 1:
            problems.append("isf_iterations must be >= 1")
        if not self.samples_per_pack >= 1:  # NaN fails too
            problems.append("samples_per_pack must be >= 1")
        problems += [f"{name} must be <= {limit}" for name, limit in LIMITS.items()
                     if getattr(self, name) is not None and getattr(self, name) > limit]
        problems += [problem for feature in FEATURES for problem in feature.problems(self)]
        if (self.vision_cap is None) != (self.token_cap is None):
            problems.append("give both vision_cap and token_cap, or neither (automatic)")
        if any(v is not None and v < 1 for v in (self.vision_cap, self.token_cap)):
            problems.append("vision_cap and token_cap must be >= 1")
        if problems:
            raise ValueError("invalid plan config: " + "; ".join(problems))

    @property
    def layout(self) -> Layout:
        """The run's degrees as one value (`packfeed.v1.layout`): dp, pipeline_stages, context_parallel and
        encoder_ranks."""
        return Layout(self.dp, self.pipeline_stages, self.context_parallel, self.encoder_ranks)

    @property
    def disaggregated(self) -> bool:
        """The encoder on ranks of its own (encoder_ranks > 0)."""
        return self.encoder_ranks > 0

    def shares_prefixes(self, grouped: bool) -> bool:
        """Whether this plan shares its groups' prefixes, for an index and a live job alike: its samples come in
        groups that share a prefix (`grouped`: an index's group column, a live step's samples with a shared
        prompt), shared_prefix on, and a strategy that packs (the padded baselines batch samples as they come).
        Such a plan must have no `prefix_sharing_refusal`."""
        return grouped and self.shared_prefix and not self.strategy.padded

    def prefix_sharing_refusal(self, further_encoders: bool = False) -> str:
        """Why a plan sharing prefixes cannot be this one, naming the way out ("": it can): the features on
        that it does not combine with (`PREFIX_SHARING_REFUSES`, and an index's further encoders)."""
        refused = [why for refuses, why in PREFIX_SHARING_REFUSES if refuses(self)] + \
            (["further encoders"] if further_encoders else [])
        return f"a plan whose groups share their prefix does not plan {' or '.join(refused)} yet; plan each " \
            "sample alone with shared_prefix false" if refused else ""

    @property
    def slots(self) -> int:
        """Packs per global step: dp x microbatches."""
        return self.dp * self.microbatches

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as their names): what plan files, fingerprints and job descriptions record."""
        out = asdict(self)
        for name in ("strategy", "oversize", "cp_mode", "staleness"):
            out[name] = getattr(self, name).value
        out["cost_model"] = self.cost_model.to_dict()
        for feature in FEATURES:  # a plan without a feature records what plans did before it existed
            on = feature.recorded(self)
            for name in feature.fields if not on else feature.recorded_when_set:
                if not on or out[name] is None:
                    del out[name]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PlanConfig:
        return cls(**raw)

    def to_proto(self) -> pb.PlanSpec:
        from packfeed.v1 import packfeed_pb2 as pb

        spec = pb.PlanSpec(**{name: 0 if value is None else value for name, value in self.to_dict().items()
                              if name != "cost_model"})
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
