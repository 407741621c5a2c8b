"""The cost model the planner balances on: per-sample cost coefficients (`CostModel`), FLOPs from a module's
shape by default (`ModuleShape`; InternVL-Chat-1.5's towers, the model OmniBal trains) or seconds a trainer
measured. Part of the contract (`packfeed.v1`, a field of `PlanConfig`): pure Python, no numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the messages are imported where converted
    from packfeed.v1 import packfeed_pb2 as pb


@dataclass(frozen=True)
class ModuleShape:
    """Enough of a transformer's shape to estimate training FLOPs."""

    params: float
    layers: int
    hidden: int
    causal: bool

    def coefficients(self) -> tuple[float, float]:
        # fwd+bwd linear FLOPs ~ 6 * params per token; attention QK^T and AV cost 4*h*s^2 per layer forward,
        # x3 with backward; causal masking halves it.
        linear = 6.0 * self.params
        quadratic = 12.0 * self.layers * self.hidden * (0.5 if self.causal else 1.0)
        return linear, quadratic


# Defaults: InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B), the model OmniBal trains.
INTERNVIT_6B = ModuleShape(params=5.9e9, layers=45, hidden=3200, causal=False)
INTERNLM2_20B = ModuleShape(params=19.9e9, layers=48, hidden=6144, causal=True)


@dataclass(frozen=True)
class CostModel:
    """Per-sample cost = linear * units + quadratic * units^2 on the vision side (ViT patches, squared per ViT
    sequence) and the LLM side (tokens, squared per sample), in any shared unit: FLOPs by default, measured
    seconds when a trainer exports them (`packfeed train` writes OUT/cost_model.json). `encoders`: the same two
    coefficients for each further encoder an index names (`packfeed index --encoder`), as (name, linear,
    quadratic) sorted by name; an encoder not listed costs what the vision encoder does per token."""

    vision_linear: float
    vision_quadratic: float
    llm_linear: float
    llm_quadratic: float
    encoders: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        encoders = tuple(sorted((str(name), float(a), float(b)) for name, a, b in
                                (self.encoders.items() if isinstance(self.encoders, dict) else self.encoders)))
        object.__setattr__(self, "encoders", encoders)
        values = [self.vision_linear, self.vision_quadratic, self.llm_linear, self.llm_quadratic]
        extra = [v for _, a, b in encoders for v in (a, b)]
        if not all(math.isfinite(v) and v >= 0 for v in values + extra) or not any(values):
            raise ValueError(f"cost_model {self.to_dict()}: coefficients must be finite, >= 0 and not all zero")
        if len({name for name, _, _ in encoders}) != len(encoders):
            raise ValueError(f"cost_model: encoders {[name for name, _, _ in encoders]} name one twice")

    def encoder(self, name: str) -> tuple[float, float]:
        """(linear, quadratic) of a further encoder: its own, or the vision encoder's when not given."""
        for known, linear, quadratic in self.encoders:
            if known == name:
                return linear, quadratic
        return self.vision_linear, self.vision_quadratic

    def to_dict(self) -> dict[str, Any]:
        """Plain values; `encoders` as {name: [linear, quadratic]}, left out when there are none (so plans without
        further encoders record what they recorded before)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "encoders"}
        if self.encoders:
            out["encoders"] = {name: [linear, quadratic] for name, linear, quadratic in self.encoders}
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CostModel:
        """The coefficients of a dict (a trainer's OUT/cost_model.json also holds its per-layer costs under
        "layers", for `packfeed simulate`); any other key is a mistake and is refused."""
        names = {f.name for f in fields(cls)}
        unknown, missing = set(values) - names - {"layers"}, names - set(values) - {"encoders"}
        if unknown or missing:
            raise ValueError(f"cost_model: unknown keys {sorted(unknown)}, missing {sorted(missing)}; it holds "
                             f"{', '.join(f.name for f in fields(cls))} (and a trainer's per-layer \"layers\")")
        encoders = values.get("encoders") or {}
        if not isinstance(encoders, dict) or not all(isinstance(v, (list, tuple)) and len(v) == 2
                                                     for v in encoders.values()):
            raise ValueError('cost_model: "encoders" maps each encoder\'s name to [linear, quadratic]')
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values and f.name != "encoders"},
                   encoders=tuple((name, *pair) for name, pair in encoders.items()))

    @classmethod
    def from_shapes(cls, vision: ModuleShape = INTERNVIT_6B, llm: ModuleShape = INTERNLM2_20B) -> CostModel:
        vl, vq = vision.coefficients()
        ll, lq = llm.coefficients()
        return cls(vl, vq, ll, lq)

    def to_proto(self) -> pb.CostCoefficients:
        from packfeed.v1 import packfeed_pb2 as pb

        message = pb.CostCoefficients(vision_linear=self.vision_linear, vision_quadratic=self.vision_quadratic,
                                      llm_linear=self.llm_linear, llm_quadratic=self.llm_quadratic)
        for name, linear, quadratic in self.encoders:
            message.encoders[name].CopyFrom(pb.EncoderCoefficients(linear=linear, quadratic=quadratic))
        return message

    @classmethod
    def from_proto(cls, message: pb.CostCoefficients) -> CostModel:
        return cls(message.vision_linear, message.vision_quadratic, message.llm_linear, message.llm_quadratic,
                   tuple((name, c.linear, c.quadratic) for name, c in message.encoders.items()))
