"""TRL's `GRPOTrainer` on Packfeed: `pip install packfeed[trl]`.

    trainer = PackfeedGRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(...),
                                  processing_class=tokenizer, target="loader:50051", job="grpo-7",
                                  family="qwen2_vl")
    trainer.train(resume_from_checkpoint=True)  # or None on the first run

One optimizer step, on every rank at once:

1. **Prompts** come from a Packfeed job over the server's prompt index (`JOB-prompts`, strategy `length-group`):
   each rank gets the same number of prompts (TRL's groups need it), balanced over the ranks on their tokens,
   images included, with their images decoded and laid out as the model's pixel values. A prompt is an indexed
   sample's tokens before its first loss token; the rest (its answer) is given to reward functions as
   `solution`, the sample's key as `key`, the prompt's text as `prompts`.
2. **TRL generates and scores** as it does (`GRPOTrainer._generate` with its sampling settings, by the model
   or, with `use_vllm=True, vllm_mode="colocate"`, by each rank's vLLM fed the same pixel values: `trl_vllm`; the reward
   functions, the group-normalised advantages of `scale_rewards` and `multi_objective_aggregation`).
3. **The scored rollouts go through a live job** (`JOB-rollouts`, docs/live.md): rank 0 puts the whole step's
   rollouts, in rank order, each with its prompt's tokens and its completion's, the completion in the loss, and
   per-token `advantages` and `loss_weight`; its images are its prompt's, by reference.
4. **The update trains on the live step's packs**: balanced on their vision and LLM work, collective-safe, and
   with each prompt computed once for its G responses (`shared_prefix`). The loss is TRL's: the clipped ratio
   (`epsilon`, `epsilon_high`, `delta`), the KL term against the reference model (`beta`, with
   `use_bias_correction_kl`), each token weighted as `loss_type` normalises it over the *global* step (`dapo`:
   the step's loss tokens; `grpo`: each completion's tokens and the step's completions; `dr_grpo`: the step's
   completions x `max_completion_length`), so the update is TRL's own on the same rollouts however they were
   packed.

Checkpoints save both streams' positions beside the Trainer's (`packfeed_grpo_rank<r>.json`): a resumed run
trains the live job's next step, the one the killed run would have. What TRL's config controls that this face
cannot honour is refused, naming the field (`check_grpo_config`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from packfeed.client.stream.channel import Connection, PackfeedError
from packfeed.client.model.dataset_losses import reward_losses
from packfeed.client.frameworks.grpo_config import check_grpo_config
from packfeed.client.frameworks.grpo_prompts import PromptSteps, prompt_stream
from packfeed.client.frameworks.grpo_rollouts import aligned, scored_rollouts
from packfeed.client.model.hf import to_hf_inputs
from packfeed.client.rollouts.prompts import Prompt
from packfeed.client.model.hf_families import family_of
from packfeed.client.frameworks.hf_trainer import load_weights_strictly, saved_state, sharded
from packfeed.client.model.losses import sample_logprobs, token_logprobs
from packfeed.client.stream.producer import Producer, Sample
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import PackTensors
from packfeed.v1.options import PlanConfig

STATE_FILE = "packfeed_grpo_rank{rank}.json"


def reference_of_built_model(model: Any, args: GRPOConfig) -> None:
    """TRL builds the reference model (beta > 0) from the policy's `config._name_or_path`, which is empty for a
    model built from a config (`from_config`, as tiny test models are): it would fail looking up repo ''. Such a
    model's initial weights are saved under the output folder and named there, so the reference starts from them."""
    config = getattr(model, "config", None)
    if args.beta == 0.0 or config is None or getattr(config, "_name_or_path", "x") \
            or not hasattr(model, "save_pretrained"):
        return
    folder = Path(args.output_dir) / f"packfeed-reference-rank{args.process_index}"
    model.save_pretrained(folder)
    config._name_or_path = str(folder)


class PackfeedGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` whose prompts come from a Packfeed job and whose updates train on a live job's
    balanced, group-aware packs (see the module's docstring). `target`: the server ("host:port", or several);
    `job`: the run's name (its jobs are JOB-prompts and JOB-rollouts); `family`: the model's
    (`packfeed.client.model.hf_families`); `dataset`: the server's prompt index, when it serves several;
    `shared_prefix`: each prompt computed once for its responses (default), or each response whole; `prompts`:
    the prompt job's stream when already open (`prompt_stream`); `prompt_window`: the prompt job's window (a
    mixture whose weights move needs one; a loss-driven one is then reported to each step, `mixture_losses`)."""

    def __init__(self, *args: Any, target: str | list[str], job: str, family: str, dataset: str = "",
                 connection: Connection | None = None, shared_prefix: bool = True,
                 prompts: PackStream | None = None, prompt_window: int = 0, **kwargs: Any):
        grpo_args: GRPOConfig = kwargs["args"]
        check_grpo_config(grpo_args)
        for name in ("rollout_func", "tools", "environment_factory"):
            if kwargs.get(name):
                raise PackfeedError(f"{name}: PackfeedGRPOTrainer generates single turns from the prompt job's "
                                    "tokens; leave it out")
        if family_of(family).image_policy != "qwen2vl":
            raise PackfeedError(f"family {family!r}: PackfeedGRPOTrainer generates from Qwen-style pixel values "
                                "(image_grid_thw); give qwen2_vl, qwen2_5_vl or qwen3_vl")
        if kwargs.get("train_dataset") is not None:
            raise PackfeedError("the prompts come from the Packfeed job: leave train_dataset out")
        kwargs["train_dataset"] = Dataset.from_dict({"prompt": [""]})  # never read: get_train_dataloader
        reference_of_built_model(kwargs.get("model", args[0] if args else None), grpo_args)
        world, rank = grpo_args.world_size, grpo_args.process_index
        accumulation, generations = grpo_args.gradient_accumulation_steps, grpo_args.num_generations
        per_rank = grpo_args.per_device_train_batch_size * accumulation // generations
        self.family, self.share, self.rank, self.world = family, shared_prefix, rank, world
        self.packfeed_job, self.packfeed_connection = job, connection or Connection()
        self.prompt_stream = prompts or prompt_stream(target, job, grpo_args, dataset=dataset,
                                                      connection=self.packfeed_connection, window=prompt_window)
        if self.prompt_stream.job != f"{job}-prompts":
            raise PackfeedError(f"prompts= streams job {self.prompt_stream.job!r}, not this run's {job}-prompts: "
                                "open it with prompt_stream(target, job, args)")
        steps, windowed = sum(self.prompt_stream.info.epoch_steps), self.prompt_stream.info.plan.window > 0
        if windowed and grpo_args.max_steps <= 0 or not windowed and grpo_args.max_steps > steps:
            self.prompt_stream.close()
            raise PackfeedError(
                "the prompt job is planned in windows, so its steps are known only once planned: give max_steps"
                if windowed else f"max_steps={grpo_args.max_steps} is past the prompt job's {steps} steps: give "
                                 "at most that, or more num_train_epochs")
        # the streams resume themselves: the Trainer must not skip batches of a resumed run again
        kwargs["args"] = grpo_args = copy.copy(grpo_args)  # the caller's stays as given (replace would re-derive)
        grpo_args.ignore_data_skip = True
        wants_vllm, grpo_args.use_vllm = grpo_args.use_vllm, False  # TRL's own engine would take raw images
        grpo_args.max_steps = grpo_args.max_steps if grpo_args.max_steps > 0 else steps
        rollout_plan = PlanConfig(dp=world, microbatches=accumulation, live=True, steps=grpo_args.max_steps,
                                  step_samples=per_rank * generations * world, shared_prefix=shared_prefix)
        self.rollout_stream = PackStream(target, job=f"{job}-rollouts", rank=rank, plan=rollout_plan,
                                         seed=grpo_args.seed, dataset=dataset, connection=self.packfeed_connection)
        self.producer = Producer(target, job=f"{job}-rollouts", connection=self.packfeed_connection) \
            if rank == 0 else None
        self.prompt_steps = PromptSteps(self.prompt_stream, family, generations, accumulation)
        self._rollout_steps: Iterator | None = None
        self._microbatches: list[list[PackTensors]] = []
        self._prompts: list[Prompt] = []
        self._rewards: torch.Tensor | None = None  # this rank's rewards of the step's responses (weighted, summed)
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.close()  # the streams and the producer are open: let go of the server
            raise
        if self.aux_loss_enabled:
            self.close()
            raise PackfeedError("router_aux_loss_coef: a mixture-of-experts router's auxiliary loss is not added "
                                "by the update on packs; set it to 0")
        self.ensure_encoders = sharded(self.args)
        self._suppress_placeholders()
        self.vllm_completions = 0  # completions vLLM generated (use_vllm)
        if wants_vllm:
            from packfeed.client.frameworks.trl_vllm import colocated_vllm

            self.use_vllm, self.vllm_mode, self._last_loaded_step = True, "colocate", -1
            self.vllm_generation = colocated_vllm(self, grpo_args)

    def _suppress_placeholders(self) -> None:
        """Never sample an image or video placeholder: a completion holding one has no features to match it (TRL
        suppresses the image token only for a processor, never the video token)."""
        conventions = self.prompt_stream.conventions
        ids = {conventions.image_context_id}
        if conventions.HasField("video_context_id"):
            ids.add(conventions.video_context_id)
        suppressed = sorted(ids | set(self.generation_kwargs.get("suppress_tokens") or []))
        self.generation_kwargs["suppress_tokens"] = suppressed
        self.generation_config.suppress_tokens = suppressed

    # -- prompts and generation ----------------------------------------------------------------------------------

    def get_train_dataloader(self) -> PromptSteps:
        return self.prompt_steps

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> None:
        return None  # the loss normalises itself over the global step (each token's loss_weight)

    def _tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], None, dict[str, torch.Tensor]]:
        """The prompts' tokens as the server tokenised them, and their images as the model's inputs."""
        fields: dict[str, list[torch.Tensor]] = {}
        for prompt in self._prompts:
            for name, value in prompt.fields.items():
                fields.setdefault(name, []).append(value)
        multimodal: dict[str, Any] = {name: torch.cat(v) for name, v in fields.items()}
        if multimodal:  # as a processor gives them: one list a prompt, which TRL pads on the left
            multimodal["mm_token_type_ids"] = [p.token_types for p in self._prompts]
        return [p.ids for p in self._prompts], None, multimodal

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring of this rank's prompts (`inputs`: their rows), as a TRL batch with the
        prompts' pixel values. The reference log-probabilities are left to the update (on balanced packs)."""
        beta, self.beta = self.beta, 0.0
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self.beta = beta
        fields = self._tokenize_prompts([])[2]
        if fields:  # what TRL's own batch carries for its forward passes
            device, width = self.accelerator.device, batch["prompt_ids"].size(1)
            types = torch.zeros((len(self._prompts), width + batch["completion_ids"].size(1)), dtype=torch.long)
            for row, prompt in enumerate(self._prompts):
                types[row, width - len(prompt.token_types):width] = torch.tensor(prompt.token_types)
            batch.update(pixel_values=fields["pixel_values"].to(device), image_grid_thw=fields["image_grid_thw"].to(device),
                         mm_token_type_ids=types.to(device),
                         num_images=[len(p.fields["image_grid_thw"]) if p.fields else 0 for p in self._prompts])
        return batch

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every rank's responses; this rank's, weighted and summed as TRL's advantages take them,
        kept for a loss-driven prompt mixture (`mixture_losses`)."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mine = slice(self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts))
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func[mine] * weights).nansum(dim=1)
        unscored = torch.isnan(rewards_per_func[mine]).all(dim=1)  # TRL leaves these out of its advantages
        self._rewards = torch.where(unscored, torch.nan, rewards).detach().double().cpu()
        return rewards_per_func

    def mixture_losses(self, prompts: list[Prompt], rewards: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
        """What this rank reports to a loss-driven prompt mixture for a step (docs/training.md "TRL's GRPO on
        Packfeed"): per dataset, minus the mean reward of its prompts' responses, over their number. A dataset the
        policy scores worse on has the higher loss: `softmax` gives it more weight; `excess_loss`'s reference is
        minus a reference policy's mean rewards. Override it for another signal (a GRPO loss averages to about 0
        by construction: it carries none)."""
        return reward_losses([prompt.source for prompt in prompts], rewards.tolist())

    def _rows(self, prompts: list[Prompt]) -> list[dict[str, Any]]:
        decode = self.processing_class.decode
        return [{"prompt": decode(p.ids), "solution": decode(p.solution), "key": p.key} for p in prompts]

    # -- the live job --------------------------------------------------------------------------------------------

    def _rollouts(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """This rank's scored rollouts as live samples (`grpo_rollouts.scored_rollouts`)."""
        total = int(self.accelerator.gather(torch.tensor([len(batch["prompt_ids"])], device=self.accelerator.device))
                    .sum().item())
        return scored_rollouts(batch, self._prompts, self.loss_type, total, self.max_completion_length,
                               self._tokenizer.pad_token_id)

    def _put_step(self, rollouts: list[dict[str, Any]]) -> None:
        """Rank 0 puts the step's rollouts of every rank, in rank order: a step's members, and so its packs, are
        the same on every run. Their ids say the step, so a step put again after a restart is stored once."""
        everyone = gather_object([rollouts])
        if self.producer is None:
            return
        step = self.state.global_step
        samples = [Sample(id=f"s{step}-r{rank}-{i}", policy_version=step, **rollout)
                   for rank, rollouts_of_rank in enumerate(everyone) for i, rollout in enumerate(rollouts_of_rank)]
        self.producer.put(samples)

    def _next_rollout_step(self) -> list[PackTensors]:
        if self._rollout_steps is None:
            self._rollout_steps = iter(self.rollout_stream)
        try:
            return next(self._rollout_steps).packs
        except StopIteration:
            raise PackfeedError(f"the live job {self.packfeed_job}-rollouts ended before the Trainer's max_steps: "
                                "its steps are the run's max_steps") from None

    def _prepare_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """At a step's first microbatch: generate and score its prompts, put the rollouts, take the live step's
        packs; each microbatch then trains its share of them (usually one pack)."""
        if batch["prompts"] is not None:
            self._prompts = batch["prompts"]
            scored = self._generate_and_score_completions(self._rows(self._prompts))
            if self.prompt_stream.loss_driven:  # every rank, every step ({} when it held no prompts)
                self.prompt_stream.report(*self.mixture_losses(self._prompts, self._rewards),
                                          step=self.prompt_steps.step)
            self._put_step(self._rollouts(scored))
            packs = self._next_rollout_step()
            count = self.args.gradient_accumulation_steps
            self._microbatches = [packs[m::count] for m in range(count)]
        return {"packs": self._microbatches[batch["microbatch"]]}

    # -- the update ----------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("PackfeedGRPOTrainer does not return outputs")
        device = self.accelerator.device
        loss = torch.zeros((), device=device)
        for pack in inputs["packs"]:
            loss = loss + self._pack_loss(model, pack, device)
        return loss

    def _pack_loss(self, model, pack: PackTensors, device: torch.device) -> torch.Tensor:
        """TRL's per-token GRPO loss over one pack, each token weighted by its share of the global step's
        normalisation, times the world size (DDP averages the ranks' gradients)."""
        share = self.share and not pack.empty
        inputs = to_hf_inputs(pack, self.family, dp=self.world, conventions=self.rollout_stream.conventions,
                              shared_prefix=share, ensure_encoders=self.ensure_encoders, device=device,
                              dtype=next(model.parameters()).dtype)
        inputs.pop("num_items_in_batch", None)
        labels = inputs.pop("labels")[0]
        logp, mask = self._logprobs(model, inputs, labels, pack, share)
        tensors = pack.token_tensors if not pack.empty else {}  # logp is per token of the pack as sent
        advantages = aligned(tensors.get("advantages"), logp)
        weights = aligned(tensors.get("loss_weight"), logp)
        old = logp.detach()  # one update per generation: TRL's old log-probabilities are the current ones
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)
        per_token = -torch.minimum(coef_1 * advantages, coef_2 * advantages)
        if "importance_ratio" in tensors:  # TRL's correction of vLLM's sampling (vllm_importance_sampling_*)
            per_token = per_token * aligned(tensors["importance_ratio"], logp)
        if self.beta != 0.0:
            with torch.no_grad():
                ref, _ = self._logprobs(self.ref_model, inputs, labels, pack, share)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * coef_1
            per_token = per_token + self.beta * kl
        return (per_token * weights * mask).sum() * self.world

    def _logprobs(self, model, inputs: dict[str, Any], labels: torch.Tensor, pack: PackTensors, share: bool):
        """Per token of the pack as sent (a tree's shared turns computed once, trained in each trajectory)."""
        with self.accelerator.autocast():  # as TRL's own forward runs (bf16, TRL's default, autocasts)
            logits = model(**inputs).logits[0]
        if pack.empty:
            return token_logprobs(logits / self.temperature, labels.to(logits.device))
        return sample_logprobs(logits / self.temperature, pack, share)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with open(os.path.join(folder, STATE_FILE.format(rank=self.rank)), "w") as out:
            json.dump({"prompts": self.prompt_stream.state_dict(), "rollouts": self.rollout_stream.state_dict()}, out)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights through the model class's loader: the Trainer's own leaves a transformers 5 VLM's weights at
        their initial values (packfeed.client.frameworks.hf_trainer)."""
        if not load_weights_strictly(self.model if model is None else model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """`Trainer.train`, both streams first moved to the step after the checkpoint's."""
        resume_from_checkpoint, saved = saved_state(resume_from_checkpoint, self.args.output_dir,
                                                    STATE_FILE.format(rank=self.rank), "PackfeedGRPOTrainer")
        if saved is not None:
            self.prompt_stream.load_state_dict(saved["prompts"])
            self.rollout_stream.load_state_dict(saved["rollouts"])
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the server: both streams and the producer (train() does so when it returns)."""
        for held in (self.producer, self.prompt_stream, self.rollout_stream):
            if held is not None:
                held.close()
