"""A rollout worker: an inference engine fed by the run's prompt job, putting scored rollouts into its live job.

    engine = VLLMEngine.from_pretrained(model_dir, dtype="bfloat16")
    prompts = prompt_job_stream(target, "run-7", consumers=workers, consumer=index, per_consumer=8)
    producer = Producer(target, job="run-7-rollouts", name=f"rollouts-{index}")
    worker = RolloutWorker(engine, prompts, producer, rewards=[exact_answer], family="qwen2_vl",
                           weights=WeightVersions("s3://bucket/run-7/weights"), generations=8)
    worker.run()                                            # the prompt job's whole run
    worker.close()

Per prompt step (this worker's share of the prompt job's step, balanced on tokens over the workers):

1. **Weights.** Under staleness `wait` (`reserve=True`) each prompt's group is reserved first (`Producer.reserve`),
   and its grant names the version to generate with; otherwise the newest published version. A version other than
   the engine's is loaded from `weights` (`WeightVersions`) before generating.
2. **Generation.** Each prompt goes to the engine exactly as the trainer will see it (`engine_io.engine_request`:
   the index's tokens, the loader server's pixel values), `generations` completions each. With `partial_tokens`
   N, they are generated N tokens at a time, and a weight version the trainer publishes meanwhile is loaded
   between chunks: the completions still running go on with it, each token keeping the version and the
   log-probability it was sampled with (`interruptible`: partial rollouts, continued in this process).
3. **Scores.** Each reward function is called as TRL calls one, with lists over the step's completions:
   `reward(prompts=..., completions=..., completion_ids=..., solution=..., key=...)` (texts decoded by the engine's
   tokenizer, `solution` the prompt's indexed answer); their weighted sum is a completion's reward, and its
   advantage the reward less its group's mean (over the group's standard deviation under `scale_rewards="group"`).
4. **Put.** Each completion becomes a live sample: the prompt's tokens then the completion's, the completion in
   the loss, per-token `logprobs` (the engine's, behaviour) and `advantages`, its reward as value `reward`, its
   group the prompt's key at this step, its images its prompt's by reference, its `policy_version` the version it
   was generated with (continued with newer weights: the newest, and each token's in `token_versions`). Ids say
   the step, so a step put again after a restart is stored once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from packfeed.client.rollouts.engine_io import Engine, Sampling, cut_at, engine_request, placeholders_of
from packfeed.client.rollouts.interruptible import Generated, generate_following
from packfeed.client.rollouts.prompts import Prompt, prompts_of
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.stream.channel import PackfeedError
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.producer import Producer, Sample
from packfeed.client.stream.tensors import Step

RewardFunction = Callable[..., Sequence[float]]


@dataclass
class RolloutReport:
    """What a worker did: prompt steps, rollouts put, the versions it loaded, and the rollouts it continued with
    newer weights than they started with (partial_tokens)."""

    steps: int = 0
    rollouts: int = 0
    versions: list[int] = field(default_factory=list)
    continued: int = 0


class RolloutWorker:
    """See the module's docstring. `weights`: where the trainer publishes its versions (None: the engine's weights
    stay, version `policy_version`); `reward_weights`: one per reward function (default 1 each); `partial_tokens`:
    generate that many tokens at a time, following newer weights between chunks (0: each completion whole)."""

    def __init__(self, engine: Engine, prompts: PackStream, producer: Producer, rewards: Sequence[RewardFunction], *,
                 family: str, weights: WeightVersions | None = None, generations: int = 4,
                 sampling: Sampling = Sampling(), reward_weights: Sequence[float] | None = None,
                 scale_rewards: Literal["group", "none"] = "group", reserve: bool = False, policy_version: int = 0,
                 weights_timeout_s: float = 600.0, partial_tokens: int = 0):
        if generations < 2 and scale_rewards == "group":
            raise PackfeedError("generations >= 2: a group's advantages are its rewards less their mean")
        if not rewards:
            raise PackfeedError("give at least one reward function")
        if reward_weights is not None and len(reward_weights) != len(rewards):
            raise PackfeedError(f"{len(reward_weights)} reward_weights for {len(rewards)} reward functions")
        if scale_rewards not in ("group", "none"):
            raise PackfeedError(f"scale_rewards={scale_rewards!r}: give 'group' or 'none'")
        if partial_tokens < 0 or (partial_tokens and weights is None):
            raise PackfeedError(f"partial_tokens={partial_tokens}: give 0 (whole completions) or a chunk of tokens, "
                                "with weights=WeightVersions(...) to follow")
        self.engine, self.prompts, self.producer, self.rewards = engine, prompts, producer, list(rewards)
        self.family, self.weights, self.generations, self.sampling = family, weights, generations, sampling
        self.reward_weights = np.asarray(reward_weights if reward_weights is not None else [1.0] * len(rewards))
        self.scale_rewards, self.reserve, self.weights_timeout_s = scale_rewards, reserve, weights_timeout_s
        self.version = policy_version  # of the weights the engine holds
        self.partial_tokens = partial_tokens
        self.report = RolloutReport()
        self._steps: Iterator[Step] | None = None
        self._placeholders = placeholders_of(prompts.conventions)  # stop tokens, cut (engine_io.cut_at)
        self._sampling = replace(sampling, stop_token_ids=tuple(sorted(set(sampling.stop_token_ids)
                                                                       | self._placeholders)))

    def run(self, steps: int | None = None) -> RolloutReport:
        """Generate for the prompt job's next `steps` steps (None: to the end of its run); call again to go on."""
        if self._steps is None:
            self._steps = iter(self.prompts)
        for step in itertools.islice(self._steps, steps):
            self.rollout_step(step)
        return self.report

    def close(self) -> None:
        """Let go of the prompt stream and the producer."""
        try:
            self.prompts.close()
        finally:
            self.producer.close()

    def rollout_step(self, step: Step) -> list[Sample]:
        """One prompt step's rollouts, generated, scored and put; returned as put."""
        conventions = self.prompts.conventions
        prompts = [p for pack in step.packs for p in prompts_of(pack, self.family, conventions)]
        newest = None if self.reserve or self.weights is None else self.weights.newest()  # read once a step
        by_version: dict[int, list[Prompt]] = {}
        for prompt in prompts:
            version = self._granted(self._group(prompt, step)) if self.reserve else \
                (self.version if newest is None else newest)
            by_version.setdefault(version, []).append(prompt)
        samples: list[Sample] = []
        for version, batch in sorted(by_version.items()):
            self._hold(version)
            requests = [engine_request(prompt, conventions) for prompt in batch]
            if self.partial_tokens:
                completions = generate_following(self.engine, requests, self.generations, self._sampling,
                                                 self.partial_tokens, self._follow, self._placeholders)
            else:
                completions = [[Generated.of(cut_at(c, self._placeholders), version) for c in group]
                               for group in self.engine.generate(requests, self.generations, self._sampling)]
            samples += self._samples(step, batch, completions)
        self.producer.put(samples)
        self.report.steps += 1
        self.report.rollouts += len(samples)
        return samples

    @staticmethod
    def _group(prompt: Prompt, step: Step) -> str:
        return f"{prompt.key}@e{step.epoch}s{step.step}"

    def _granted(self, group: str) -> int:
        """The version a group's grant names (staleness wait: reserved before it is generated)."""
        return self.producer.reserve(group=group, samples=self.generations).policy_version

    def _follow(self) -> int:
        """Between chunks: the newest published version loaded when it is newer than the engine's; the engine's."""
        newest = self.weights.newest()
        if newest is not None and newest > self.version:
            self._hold(newest)
        return self.version

    def _hold(self, version: int) -> None:
        """The engine holds `version`'s weights (loaded from `weights` when it holds another)."""
        if version == self.version:
            return
        if self.weights is None:
            raise PackfeedError(f"the job's grant names policy version {version}, and this worker holds "
                                f"{self.version} with nowhere to load others from: give weights=WeightVersions(...)")
        self.engine.load_version(self.weights, version, self.weights_timeout_s)
        self.version = version
        self.report.versions.append(version)

    def _samples(self, step: Step, prompts: list[Prompt], completions: list[list[Generated]]) -> list[Sample]:
        flat = [(prompt, c) for prompt, group in zip(prompts, completions) for c in group]
        rewards = self._rewards(flat)
        out = []
        for index, prompt in enumerate(prompts):
            group_rewards = rewards[index * self.generations:(index + 1) * self.generations]
            advantages = group_rewards - group_rewards.mean()
            if self.scale_rewards == "group":
                advantages = advantages / (group_rewards.std() + 1e-4)
            name = self._group(prompt, step)
            for member, (completion, reward, advantage) in enumerate(zip(completions[index], group_rewards,
                                                                          advantages)):
                out.append(_sample(f"{name}-{member}", name, prompt, completion, float(reward), float(advantage)))
                self.report.continued += completion.continued
        return out

    def _rewards(self, flat: list[tuple[Prompt, Generated]]) -> np.ndarray:
        """Each completion's reward: the reward functions' outputs, weighted and summed."""
        decode = self.engine.decode
        columns = {"prompts": [decode(p.ids) for p, _ in flat], "completions": [decode(c.token_ids.tolist())
                                                                               for _, c in flat],
                   "completion_ids": [c.token_ids.tolist() for _, c in flat],
                   "solution": [decode(p.solution) for p, _ in flat], "key": [p.key for p, _ in flat]}
        scores = np.zeros((len(flat), len(self.rewards)))
        for column, reward in enumerate(self.rewards):
            given = list(reward(**columns))
            if len(given) != len(flat) or any(v is None or not np.isfinite(v) for v in given):
                raise PackfeedError(f"reward function {getattr(reward, '__name__', reward)!r} gave {given[:8]}...: "
                                    f"give one finite number per completion ({len(flat)})")
            scores[:, column] = given
        return scores @ self.reward_weights


def _sample(sample_id: str, group: str, prompt: Prompt, completion: Generated, reward: float,
            advantage: float) -> Sample:
    """A scored completion as a live sample: the prompt's tokens (as the trainer sees them) then the completion's;
    each token's version where it was generated with more than one (the prompt's: the first)."""
    length, version = len(prompt.ids), completion.version
    token_versions = np.r_[np.full(length, completion.started), completion.versions].astype(np.int64) \
        if completion.continued else None
    tokens = np.concatenate([np.asarray(prompt.ids, np.int64), completion.token_ids]).astype(np.int32)
    mask = np.r_[np.zeros(length), np.ones(len(completion.token_ids))].astype(np.uint8)
    behaviour = np.r_[np.zeros(length), completion.logprobs].astype(np.float32)
    return Sample(tokens=tokens, id=sample_id, loss_mask=mask, group=group, policy_version=version,
                  prompt=prompt.key, values={"reward": reward}, token_versions=token_versions,
                  tensors={"logprobs": behaviour, "advantages": (mask * advantage).astype(np.float32)})
