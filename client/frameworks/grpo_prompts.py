"""The prompts of a TRL GRPO run as the Trainer's batches: the run's prompt job (`packfeed.client.rollouts.prompts`)
sized from its `GRPOConfig`, each rank's prompts of a step repeated G times. `packfeed.client.frameworks.trl` trains
on them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from packfeed.client.rollouts.prompts import prompt_job_stream, prompts_of
from packfeed.client.stream.channel import Connection
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import Step


class PromptSteps:
    """The Trainer's batches: per optimizer step, its M microbatches; the first carries this rank's prompts of
    the step (each repeated G times, as TRL's sampler repeats them), the others only their number."""

    def __init__(self, stream: PackStream, family: str, generations: int, microbatches: int):
        self.stream, self.family = stream, family
        self.generations, self.microbatches = generations, microbatches
        self.step: Step | None = None  # the prompt step handed out last

    def __iter__(self) -> Iterator[dict[str, Any]]:
        conventions = self.stream.conventions
        for step in self.stream:
            self.step = step
            prompts = [p for pack in step.packs for p in prompts_of(pack, self.family, conventions)]
            repeated = [p for p in prompts for _ in range(self.generations)]
            for microbatch in range(self.microbatches):
                yield {"prompts": repeated if microbatch == 0 else None, "microbatch": microbatch}

    def __len__(self) -> int:
        if self.stream.info.plan.window:  # as any iterable without a length: the Trainer relies on max_steps
            raise TypeError("a windowed prompt job's steps are known once planned")
        return sum(self.stream.info.epoch_steps) * self.microbatches


def prompt_stream(target: str | list[str], job: str, args: Any, *, dataset: str = "",
                  connection: Connection | None = None, window: int = 0) -> PackStream:
    """This rank's stream of the run's prompt job (JOB-prompts; `args`: the run's `GRPOConfig`): each rank the same number of prompts a step (its
    generation batch's, per_device_train_batch_size x gradient_accumulation_steps / num_generations), balanced
    over the ranks on their tokens (`length-group`), for num_train_epochs. Its `conventions` size a model built
    for the dataset (`packfeed.client.model.hf.model_config`); `PackfeedGRPOTrainer(prompts=...)` takes it. `window`:
    samples planned at a time, which a mixture whose weights move needs (docs/planning.md "Mixtures that move")."""
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    return prompt_job_stream(target, job, consumers=args.world_size, consumer=args.process_index,
                             per_consumer=per_rank, seed=args.seed, epochs=int(math.ceil(args.num_train_epochs)),
                             dataset=dataset, connection=connection, window=window)
