"""A whole model on every data-parallel rank, sharded with FSDP2 over them, trained one pack at a time: the
layout for a model run as its library runs it (a `transformers` VLM at parallel.pp=1), as a `StepRunner`.

FSDP2 (`fully_shard`) is applied to the model's layer list (its units: every LLM decoder layer), then to the
root. The units are the layers every pack runs, text-only packs included: the vision tower stays in the root's
group, so a rank whose packs hold no image never leaves the others waiting in an all-gather it skips. Each of
the rank's M packs runs forward and backward in turn (gradients accumulate; the adapter normalises each pack's
loss over the whole global step, so the shares of all ranks sum to the step's mean token loss).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any, Protocol

import torch

from packfeed.client.stream.tensors import Step
from packfeed.trainer.batch import StepShape
from packfeed.trainer.models.layer_model import pack_features
from packfeed.trainer.parallel.data_parallel import shard
from packfeed.trainer.parallel.mesh import Mesh
from packfeed.trainer.parallel.pipeline import clip_gradients
from packfeed.trainer.parallel.runner import StepTally, agree_on_step


class WholeModel(Protocol):
    """What the runner needs of a model: the module, the layers to shard as units, each pack's inputs."""

    module: torch.nn.Module
    meta: dict

    def units(self) -> list[torch.nn.Module]:
        """The layers FSDP2 shards as units of their own (run by every pack)."""

    def pack_inputs(self, pack: Any, dp: int, device: torch.device) -> tuple[dict, int, int]:
        """The model's keyword inputs for one pack (its loss normalised over the global step of `dp` ranks),
        the real tokens in it and the token slots it computes (padding included)."""


class WholeModelRunner:
    """A `StepRunner`: the sharded model, fed every pack of the rank's step (its source yields the client's
    steps unchanged)."""

    def __init__(self, model: WholeModel, mesh: Mesh, source, precision: str = "fp32"):
        if mesh.pp != 1:
            raise ValueError("a whole model on every rank runs data-parallel only: set parallel.pp=1, or train a "
                             "model cut into pipeline stages")
        self.mesh, self.source, self.adapter, self.meta = mesh, source, model, dict(model.meta)
        self.model = shard(model.module, model.units(), mesh, precision)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def checkpoint_module(self) -> torch.nn.Module:
        return self.model

    def agree(self, step: Step | None) -> StepShape:
        return agree_on_step(step, self.mesh)

    def train_step(self, shape: StepShape, step: Step) -> StepTally:
        loss_sum, tokens, slots, features = 0.0, 0, 0, []
        for pack in step.packs:
            inputs, real, computed = self.adapter.pack_inputs(pack, self.mesh.dp, self.mesh.device)
            loss = self.model(**inputs).loss
            loss.backward()
            loss_sum += float(loss.detach())
            tokens, slots = tokens + real, slots + computed
            features.append(asdict(pack_features(pack, computed)))
        # each pack's loss is its token sum / (the step's tokens / dp): the ranks' shares sum to dp x the mean
        return StepTally(loss_sum / self.mesh.dp, tokens=tokens, padded_tokens=slots, samples_by_dataset=dict(Counter(step.sample_sources)),
                         microbatches=features if self.mesh.rank == 0 else None)

    def clip_gradients(self, max_norm: float) -> float:
        return clip_gradients(self.parameters(), self.mesh, max_norm)

