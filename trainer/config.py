"""Plain dataclass configs for `packfeed train`, loadable from YAML/JSON and overridable from the command line."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from packfeed.trainer.model import VLMConfig


@dataclass
class DataConfig:
    """Where packs come from: running servers (`target`) or an embedded one started on `index` (with a
    target too, the index only sizes the model: tile size, tokens per tile, vocabulary)."""

    target: str = ""  # host:port, host:port,host:port (failover), or redis://host:6379/0 (every live server)
    index: str = ""
    job: str = "train"
    seed: int = 0
    microbatches: int = 4
    strategy: str = ""  # planner strategy; "" = server default (isf+balance)
    epochs: int = 1
    vision_cap: int = 0
    token_cap: int = 0
    server_workers: int = 0  # embedded server's pre-processing processes; 0 = its default
    prefetch: int = 2
    token: str = ""
    token_multiple: int = 64  # pad each step's microbatches to a multiple of this many tokens
    cost_model: str = ""  # JSON of planner cost coefficients, e.g. an earlier run's OUT/cost_model.json


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 2
    schedule: str = "1f1b"  # or "gpipe"
    backend: str = ""  # "" = nccl on CUDA, gloo on CPU
    precision: str = "fp32"  # or "bf16" / "fp16": autocast, and activations cross stages in that dtype
    device: str = ""  # "" = cuda when available


@dataclass
class PartitionConfig:
    """How layers are split across stages: 'search' (OmniBal §4.2), 'layers', 'params', or explicit
    `bounds`. A saved decision (`file`) is reused on restart when it matches the model and stage count."""

    mode: str = "search"
    bounds: list[int] = field(default_factory=list)
    radius: int = 1
    top_k: int = 4
    profile_steps: int = 2
    trial_steps: int = 2
    comm_gbps: float = 0.0  # boundary bandwidth for the ranking metric; 0 = measure on this mesh


@dataclass
class RecomputeConfig:
    """'adaptive' (OmniBal §4.3: fewest recomputed layers that fit `budget_mb`), 'none', 'all' or explicit
    per-layer `layers`. CUDA measures with torch.cuda memory statistics; CPU with the bytes autograd saves."""

    mode: str = "adaptive"
    budget_mb: float = 0.0  # per stage; 0 = no limit (CUDA: free device memory)
    layers: list[bool] = field(default_factory=list)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.01
    steps: int = 0  # 0 = until the stream ends
    warmup_steps: int = 10
    clip_grad_norm: float = 1.0  # over the whole model across stages; 0 = no clipping


@dataclass
class CheckpointConfig:
    """OUT/checkpoints/: weights, optimizer and stream position every `every` steps; a restarted run
    continues from the newest complete one at exactly the next step (see packfeed.trainer.checkpoint)."""

    every: int = 0  # steps between checkpoints; 0 = none
    keep: int = 2  # newest complete checkpoints kept
    resume: bool = True


@dataclass
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _build(cls, raw: dict[str, Any], where: str):
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(where + k for k in unknown)}; "
                         f"known: {', '.join(where + k for k in known)}")
    values = {}
    for name, value in raw.items():
        default = getattr(cls(), name) if name in known else None
        values[name] = _build(type(default), value, f"{where}{name}.") if is_dataclass(default) else value
    return cls(**values)


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
