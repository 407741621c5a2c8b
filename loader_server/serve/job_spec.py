"""What a job is, as a client asks for it: (dataset, plan config, seed, epochs), and the elastic resume it may
continue (`Resume`); and `JobError`, a request a job cannot honour. The datasets and the jobs both speak in
these terms, so they live apart from either."""

from __future__ import annotations

import json
from dataclasses import dataclass

from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import PlanConfig


class JobError(Exception):
    """A request the job cannot honour; `code` names the gRPC status it maps to."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Resume:
    """Elastic resume (packfeed.v1 ResumeFrom): an old job with plan settings `plan_config` and `seed`, whose
    plan was `plan_fingerprint` (of its epoch 0) over index `index_fingerprint`, consumed the steps before `step`
    of epoch `epoch` on every rank. `previous`: the old job's own resume, when it was itself resumed."""

    plan_config: PlanConfig
    epoch: int
    step: int
    plan_fingerprint: str
    seed: int
    index_fingerprint: str = ""
    previous: Resume | None = None

    def to_dict(self) -> dict:
        out = {"plan": self.plan_config.to_dict(), "epoch": self.epoch, "step": self.step,
               "plan_fingerprint": self.plan_fingerprint, "index_fingerprint": self.index_fingerprint,
               "seed": self.seed}
        if self.previous is not None:
            out["previous"] = self.previous.to_dict()
        return out

    def to_proto(self) -> pb.ResumeFrom:
        message = pb.ResumeFrom(plan=self.plan_config.to_proto(), epoch=self.epoch, step=self.step,
                                plan_fingerprint=self.plan_fingerprint, index_fingerprint=self.index_fingerprint,
                                seed=self.seed)
        if self.previous is not None:
            message.previous.CopyFrom(self.previous.to_proto())
        return message


@dataclass(frozen=True)
class JobSpec:
    job: str
    dataset: str
    plan_config: PlanConfig  # how its epochs are planned (`epoch_plan(e)` is epoch e's plan)
    seed: int
    epochs: int = 1
    resume: Resume | None = None

    def describe(self) -> str:
        plan = self.plan_config.to_dict()  # the cost model included: other costs, other packs
        described = {"dataset": self.dataset, "plan": plan, "seed": self.seed, "epochs": self.epochs}
        if self.resume is not None:
            described["resume"] = self.resume.to_dict()
        return json.dumps(described, sort_keys=True)
