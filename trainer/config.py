"""Plain dataclass configs for `packfeed train`, loadable from YAML/JSON and overridable from the command line.

Every section is frozen and checked when it is made (`Literal` choices included), so a bad value fails at
start, never mid-run, and the config the run dumps is the config the user gave. The plan settings in `data`
are those of the contract's `PlanConfig` (same names and defaults; dp and pipeline stages come from the mesh).
"""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from packfeed.trainer.models.reference import VLMConfig
from packfeed.v1.layout import Layout
from packfeed.v1.options import Oversize, PlanConfig, Strategy

# DataConfig fields that are PlanConfig's (the rest of PlanConfig comes from the mesh or keeps its default)
PLAN_FIELDS = ("microbatches", "strategy", "vision_cap", "token_cap", "oversize", "collective_safe", "shared_prefix",
               "window")


def check_choices(config) -> None:
    """Raise ValueError when a `Literal`-typed field holds a value outside its choices."""
    for name, hint in typing.get_type_hints(type(config)).items():
        if typing.get_origin(hint) is Literal and getattr(config, name) not in typing.get_args(hint):
            raise ValueError(f"{type(config).__name__}.{name} = {getattr(config, name)!r}: choose one of "
                             f"{', '.join(map(str, typing.get_args(hint)))}")


# models packfeed train runs context-parallel: "" the reference VLM, then the Hugging Face families
CP_MODELS = ("", "qwen2_vl")

@dataclass(frozen=True)
class DataConfig:
    """Where packs come from: running servers (`target`) or an embedded one started on `index` or `mixture`. The
    model is sized from what the server reports of the dataset (`JobInfo.conventions`), never from the index file."""

    target: str = ""  # host:port, host:port,host:port (failover), or redis://host:6379/0 (every live server)
    index: str = ""  # without a target: start a server for this index on rank 0 (all ranks on one machine)
    mixture: str = ""  # ... or for this mixture file (docs/planning.md "Mixtures")
    dataset: str = ""  # the server's dataset to train on, when it serves several (a mixture: its `name:`)
    window: int = 0  # plan in windows of this many samples (0: whole epochs); a mixture whose weights move needs it
    job: str = "train"
    seed: int = 0
    microbatches: int = 4
    strategy: str = Strategy.ISF_BALANCE.value  # see packfeed.v1.options.Strategy
    oversize: str = Oversize.ALONE.value  # see packfeed.v1.options.Oversize
    epochs: int = 1
    vision_cap: int | None = None  # None = automatic caps
    token_cap: int | None = None
    server_workers: int = 0  # embedded server's pre-processing processes; 0 = its default
    prefetch: int = 2
    token: str = ""
    token_multiple: int = 64  # pad each step's microbatches to a multiple of this many tokens
    cost_model: str = ""  # JSON of planner cost coefficients, e.g. an earlier run's OUT/cost_model.json
    # packed, or padded: an HF model sees each pack's samples as a padded batch (every sample padded to the
    # pack's longest; the same loss; at pp=1 HF's own collation with an attention mask and sdpa): the baseline
    # that packing is measured against
    collate: Literal["packed", "padded"] = "packed"
    # context parallelism (the plan's C is parallel.cp): tokens one GPU may hold of a microbatch (None: the token
    # cap) and how packs get their degree (dynamic, or static: every pack over all C GPUs)
    max_tokens_per_gpu: int | None = None
    cp_mode: str = "dynamic"
    # the plan's collective_safe (docs/training.md): off, as this trainer shards the vision tower with the root
    # unit (or not at all), so no rank ever waits on another's tower; on, packs are laid out as a trainer that
    # wraps the tower apart needs, at some cost in balance
    collective_safe: bool = False
    # the plan's shared_prefix (docs/planning.md "Groups"): a group's samples planned together and its prompt
    # computed once; false: each sample alone
    shared_prefix: bool = True

    def __post_init__(self):
        check_choices(self)
        if self.index and self.mixture:
            raise ValueError("give data.index or data.mixture (the embedded server's dataset), not both")
        if self.cost_model and not Path(self.cost_model).is_file():
            raise ValueError(f"data.cost_model {self.cost_model} not found (an earlier run's OUT/cost_model.json)")
        self.plan_config(dp=1, pipeline_stages=1)  # a bad strategy or cap fails now, not at the first stream
        if self.max_tokens_per_gpu is not None or self.cp_mode != "dynamic":
            self.plan_config(dp=1, pipeline_stages=1, cp=2)  # ... and a bad CP setting

    def plan_config(self, dp: int, pipeline_stages: int, routed: bool = False, cp: int = 1,
                    encoder_ranks: int = 0) -> PlanConfig:
        """The job's plan specification for dp replicas of `pipeline_stages` stages, `cp` the plan's C (parallel.cp)
        and `encoder_ranks` of the encoder's own. isf+phases is served routed only to
        a trainer that exchanges encoder outputs (`routed`, parallel.encoder=phases); to the others, colocated."""
        values = {name: getattr(self, name) for name in PLAN_FIELDS}
        if encoder_ranks:
            values["encoder_ranks"] = encoder_ranks
            routed = True  # isf+phases with encoder ranks: the plan's encoder_rank names them
        if cp > 1:
            values.update(context_parallel=cp, max_tokens_per_gpu=self.max_tokens_per_gpu, cp_mode=self.cp_mode)
        if self.cost_model:
            values["cost_model"] = json.loads(Path(self.cost_model).read_text())
        if Strategy.parse(self.strategy, "data.strategy") is Strategy.ISF_PHASES and not routed:
            values["colocate_encoder"] = True
        return PlanConfig(dp=dp, pipeline_stages=pipeline_stages, **values)


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    pp: int = 2
    # interleaved_1f1b: each rank runs `virtual_stages` stages (smaller warm-up bubbles; P x V partition runs)
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = 2  # stages per rank with interleaved_1f1b
    # within a pipeline stage, over its replicas: ddp (replicated weights) or fsdp (FSDP2: sharded weights,
    # gradients and optimizer state; after the partition search, whose trials run with DDP)
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    # where the vision encoder runs: in the first pipeline stages (stages), or on every pipeline rank in the
    # schedule's idle time with the stages holding only the LLM (bubbles: Optimus; packfeed.trainer.parallel.bubbles),
    # or on every DP rank over the images the plan routes to it, joined to the LLM by an all-to-all (phases:
    # OrchMLLM, plan strategy isf+phases; packfeed.trainer.parallel.phases), or on `encoder_ranks` processes of its
    # own beside the dp x pp LLM ranks, each step's images balanced over them (disaggregated: DistTrain;
    # packfeed.trainer.parallel.disaggregated)
    encoder: Literal["stages", "bubbles", "phases", "disaggregated"] = "stages"
    # parallel.encoder=disaggregated: the encoder's processes (E); the run has dp x pp + E. auto: E searched by
    # `packfeed simulate`'s search for `packfeed train --nproc G` (packfeed.cli.encoder_split), dp the rest / pp
    encoder_ranks: int | str = 0
    backend: Literal["", "nccl", "gloo"] = ""  # "" = nccl on CUDA, gloo on CPU
    # a collective that waits longer fails the run, naming the ranks that stopped responding (a hung or stopped
    # process, a dead host): the process group's timeout (packfeed.trainer.liveness)
    timeout_s: float = 600.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16/fp16: autocast, and activations cross stages in that dtype
    device: str = ""  # "" = cuda when available
    # context parallelism: GPUs per DP replica (a power of 2); each pack runs on the 1, 2, ..., cp of them the plan
    # gives it (data.max_tokens_per_gpu, data.cp_mode; packfeed.trainer.parallel.context_parallel); at pp 1
    cp: int = 1
    # how a CP plan's packs train: split over the GPUs the plan gives each (dp x cp processes), or whole on one GPU
    # per replica (dp processes, each reading its replica's cp shares and joining them:
    # packfeed.client.model.context_parallel.JoinedStream), the baseline a CP run is checked against
    train_cp_packs: Literal["split", "whole"] = "split"

    def __post_init__(self):
        check_choices(self)
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s = {self.timeout_s}: give the seconds a collective may wait, > 0")
        auto = self.encoder_ranks == "auto"
        if not auto and (not isinstance(self.encoder_ranks, int) or isinstance(self.encoder_ranks, bool)):
            raise ValueError(f"parallel.encoder_ranks = {self.encoder_ranks!r}: give a number of processes or auto")
        if problems := self.plan_layout.problems():  # the degrees' rules, the plan's and the server's too
            raise ValueError("parallel: " + "; ".join(problems))
        if self.train_cp_packs == "whole" and self.cp == 1:
            raise ValueError("parallel.train_cp_packs=whole trains a CP plan's packs whole: set parallel.cp to the "
                             "plan's C (> 1)")
        if self.cp > 1 and self.encoder != "stages":
            raise ValueError("parallel.cp > 1 runs the encoder on each pack's GPUs (parallel.encoder=stages)")
        if self.cp > 1 and self.data_parallel == "fsdp":
            raise ValueError("parallel.cp > 1 keeps every weight on every GPU of DP x CP and all-reduces the gradients: "
                             "set parallel.data_parallel=ddp. (Sharding over DP x CP is not offered: a dynamic CP "
                             "plan's packs span a varying number of a replica's GPUs, so it cannot keep every GPU "
                             "calling a sharded vision tower together; its plan summary says so, collective_safe "
                             "off_because)")
        if self.encoder == "bubbles" and self.pp < 2:
            raise ValueError("parallel.encoder=bubbles fills a pipeline's idle time: it needs parallel.pp >= 2 (one "
                             "stage has no bubbles; use parallel.encoder=stages)")
        if self.encoder == "bubbles" and (self.schedule == "interleaved_1f1b" or self.data_parallel == "fsdp"):
            raise ValueError("parallel.encoder=bubbles runs the 1f1b or gpipe schedule with ddp-style replicas: set "
                             "parallel.schedule=1f1b (or gpipe) and parallel.data_parallel=ddp")
        if self.encoder == "phases" and (self.pp != 1 or self.data_parallel != "ddp"):
            raise ValueError("parallel.encoder=phases routes encoder outputs between data-parallel ranks that each "
                             "hold the whole model: set parallel.pp=1 and parallel.data_parallel=ddp (pipelines "
                             "encode in their stages or bubbles)")
        if (self.encoder == "disaggregated") != (auto or self.encoder_ranks > 0) or not auto and self.encoder_ranks < 0:
            raise ValueError(f"parallel.encoder_ranks = {self.encoder_ranks} with parallel.encoder={self.encoder}: the "
                             "encoder on processes of its own takes parallel.encoder=disaggregated and "
                             "parallel.encoder_ranks >= 1 (or auto) together (other placements leave it at 0)")
        if self.encoder == "disaggregated" and (self.data_parallel != "ddp" or self.schedule == "interleaved_1f1b"):
            raise ValueError("parallel.encoder=disaggregated runs the LLM with parallel.data_parallel=ddp and, "
                             "pipelined, parallel.schedule=1f1b or gpipe (FSDP2 and virtual stages with encoder ranks "
                             "are not supported yet)")
        if self.schedule == "interleaved_1f1b" and (self.pp < 2 or self.virtual_stages < 2):
            raise ValueError("parallel.schedule=interleaved_1f1b needs parallel.pp >= 2 and parallel.virtual_stages "
                             ">= 2 (each rank runs that many stages); use 1f1b otherwise")


    @property
    def layout(self) -> Layout:
        """The run's degrees as one value (`packfeed.v1.layout`): its processes' (a CP plan trained whole runs at
        cp 1)."""
        return self.plan_layout if self.train_cp_packs == "split" else replace(self.plan_layout, cp=1)

    @property
    def plan_layout(self) -> Layout:
        """The degrees as the plan has them: a CP plan trained whole still plans cp (its runner is the CP one);
        encoder_ranks=auto counts as some (its number is searched at launch)."""
        ranks = self.encoder_ranks
        return Layout(self.dp, self.pp, self.cp, 1 if ranks == "auto" else ranks)

    @property
    def world(self) -> int:
        """The processes the run trains on: dp x cp x pp, and the encoder's own."""
        if self.encoder_ranks == "auto":
            raise ValueError("parallel.encoder_ranks=auto: the split is searched for the run's processes; launch "
                             "with packfeed train --nproc G")
        return self.layout.world


@dataclass(frozen=True)
class PartitionConfig:
    """How layers are split across stages: 'search' (OmniBal §4.2), 'layers', 'params', or explicit
    `bounds`. A saved decision (`file`) is reused on restart when it matches the model and stage count."""

    mode: Literal["search", "layers", "params"] = "search"
    bounds: tuple[int, ...] = ()
    # OmniBal's reach: radius 3, 10-15 candidates timed 3 steps each; smaller defaults keep start-up short
    radius: int = 1  # boundaries jittered up to this many layers from the anchor's (0-3)
    top_k: int = 4  # best-ranked candidates timed in the real pipeline (and the layer-count split)
    profile_steps: int = 2
    trial_steps: int = 2  # steps each timed candidate runs
    comm_gbps: float = 0.0  # boundary bandwidth for the ranking metric; 0 = measure on this mesh

    def __post_init__(self):
        check_choices(self)
        object.__setattr__(self, "bounds", tuple(self.bounds))
        if not 0 <= self.radius <= 3:
            raise ValueError(f"partition.radius = {self.radius}: choose 0 to 3 (OmniBal jitters boundaries by up to 3 "
                             f"layers; the candidates grow as (2 x radius + 1)^(stages - 1))")
        if self.top_k < 0 or self.trial_steps < 1 or self.profile_steps < 1:
            raise ValueError("partition.top_k must be >= 0, partition.trial_steps and profile_steps >= 1")


@dataclass(frozen=True)
class RecomputeConfig:
    """'adaptive' (OmniBal §4.3: fewest recomputed layers that fit `budget_mb`), 'none', 'all' or explicit
    per-layer `layers`. CUDA measures with torch.cuda memory statistics; CPU with the bytes autograd saves."""

    mode: Literal["adaptive", "none", "all"] = "adaptive"
    budget_mb: float = 0.0  # per pipeline rank; 0 = CUDA: 90% of the device's memory; CPU: no limit (no trials)
    layers: tuple[bool, ...] = ()

    def __post_init__(self):
        check_choices(self)
        object.__setattr__(self, "layers", tuple(self.layers))


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.01
    steps: int = 0  # 0 = until the stream ends
    warmup_steps: int = 10
    clip_grad_norm: float = 1.0  # over the whole model across stages; 0 = no clipping


@dataclass(frozen=True)
class CheckpointConfig:
    """OUT/checkpoints/: weights, optimizer and stream position every `every` steps; a restarted run
    continues from the newest complete one at exactly the next step (see packfeed.trainer.checkpoint)."""

    every: int = 0  # steps between checkpoints; 0 = none
    keep: int = 2  # newest complete checkpoints kept
    resume: bool = True


@dataclass(frozen=True)
class TrainConfig:
    model: VLMConfig = field(default_factory=VLMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out: str = "train-out"  # decisions (partition.json, recompute.json) and metrics.jsonl
    log_every: int = 1

    def __post_init__(self):
        if self.parallel.encoder == "disaggregated" and self.model.hf:
            raise ValueError("parallel.encoder=disaggregated trains the reference model; Hugging Face models run "
                             "their vision tower with the LLM (parallel.encoder=stages)")
        if self.parallel.encoder == "disaggregated" and self.recompute.layers:
            raise ValueError("recompute.layers chooses layers of pipeline stages that hold the encoder; with "
                             "parallel.encoder=disaggregated use recompute.mode=all or none")
        if self.parallel.encoder == "phases" and (self.model.hf or Strategy.parse(
                self.data.strategy, "data.strategy") is not Strategy.ISF_PHASES):
            raise ValueError("parallel.encoder=phases trains the reference model on routed packs: set "
                             "data.strategy=isf+phases, and leave model.hf unset (Hugging Face models encode "
                             "colocated: data.strategy=isf+phases with parallel.encoder=stages)")
        planned_cp = self.parallel.cp
        if planned_cp > 1 and self.model.hf not in CP_MODELS:
            raise ValueError(f"context parallelism trains the reference model or model.hf={' or '.join(CP_MODELS[1:])}"
                             f", not {self.model.hf}: train {self.model.hf} without parallel.cp")
        if planned_cp == 1 and (self.data.max_tokens_per_gpu is not None or self.data.cp_mode != "dynamic"):
            raise ValueError("data.max_tokens_per_gpu and data.cp_mode apply to context parallelism: set parallel.cp")
        if self.model.hf and self.parallel.pp > 1 and self.model.hf_attention == "sdpa":
            raise ValueError("model.hf_attention=sdpa needs the dense mask HF builds inside its forward, which "
                             "pipeline stages do not run: use auto, varlen or flash_attention_2 with parallel.pp > 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# settings that moved, and what says the same now
MOVED = {"data.context_parallel": "parallel.cp=C parallel.train_cp_packs=whole (a CP plan's packs trained whole)"}


def _build(cls, raw: dict[str, Any], where: str):
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if moved := [where + k for k in unknown if where + k in MOVED]:
        raise ValueError("; ".join(f"{name} moved: set {MOVED[name]}" for name in moved))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(where + k for k in unknown)}; "
                         f"known: {', '.join(where + k for k in known)}")
    sections = typing.get_type_hints(cls)
    values = {}
    for name, spec in known.items():
        section = sections[name]
        if is_dataclass(section):
            values[name] = _build(section, raw.get(name) or {}, f"{where}{name}.")
        elif name in raw:
            values[name] = raw[name]
    try:
        return cls(**values)
    except TypeError as error:  # a value of the wrong kind, e.g. a list where a number belongs
        raise ValueError(f"{where or 'config'}: {error}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """YAML or JSON file, then `section.key=value` overrides (values parsed as YAML: 2, 1e-3, [0,5,9], true)."""
    raw: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return _build(TrainConfig, raw, "")


def dump_config(config: TrainConfig) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
