"""`transformers.Trainer` (and TRL's `SFTTrainer`) fed by a `PackStream`: `pip install packfeed[hf-trainer]`.

    stream = PackStream("loader:50051", job="sft", rank=rank, dp=world, microbatches=4, epochs=2)
    args = packfeed_training_arguments(stream, output_dir="out", learning_rate=1e-5, save_steps=500)
    trainer = PackfeedTrainer(model=model, args=args, stream=stream, family="qwen2_vl")
    trainer.train(resume_from_checkpoint=True)  # or None on the first run

What it takes care of, each of which a hand-made integration gets silently wrong:

- One optimizer step per Packfeed step: each pack is one batch of the Trainer and
  `gradient_accumulation_steps` is the job's M, so the step's packs accumulate into one update.
- The loss is normalised by the global step's loss tokens: `num_items_in_batch` is the step's
  `step_loss_tokens` (every rank, every microbatch), not a count of this rank's labels. With
  `average_tokens_across_devices` (the default) the Trainer scales the loss by the world size and DDP averages
  the gradients, so the update is the token mean over the whole step.
- No re-sharding: the Trainer's own dataloader (a sampler over a dataset, then Accelerate's sharding) is
  replaced by this rank's packs as the server sends them. Packs are never collated or padded again.
- The stream's position is saved in every Trainer checkpoint (`packfeed_stream_rank<r>.json` beside
  `rng_state_<r>.pth`), and `train(resume_from_checkpoint=...)` loads it before training: a resume lands on
  exactly the next step. The Trainer's own data skipping is off (`ignore_data_skip`), since the stream
  already continues where it was.
- The model's weights come back on resume: transformers 5's Trainer saves VLMs under legacy key names and loads
  them back renaming nothing, so its own resume silently restarts from the initial weights (Qwen2-VL, 5.24);
  here they load through the model class's `from_pretrained`, strictly.

- On a loss-driven mixture (a mixture file's `rule:`, docs/planning.md "Weights the loss moves") every rank
  reports each step's loss per dataset by itself, read from the model's outputs (`packfeed.client.model.dataset_losses`).

- What cannot hold is refused: `num_train_epochs` other than the job's, `max_steps` past its last step, a model
  whose vocabulary or placeholder ids are not the dataset's. Logs speak the job's terms (`epoch`, and
  `packfeed_step` k of `packfeed_steps` N), and `trainer.packfeed_step` is the step being trained (its
  `sample_keys`).

`PackfeedTrainerMixin` gives the same to any Trainer subclass: `class MySFT(PackfeedTrainerMixin, SFTTrainer)`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from packfeed.client.stream.channel import PackfeedError
from packfeed.client.model.dataset_losses import StepLosses, fused_token_losses, token_losses
from packfeed.client.model.guard_updates import SkipGuardOnlyTowerUpdates
from packfeed.client.model.hf import check_model, to_hf_inputs
from packfeed.client.stream.loaders import job_batches, job_progress, job_steps
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import PackTensors, Step

STATE_FILE = "packfeed_stream_rank{rank}.json"


def packfeed_training_arguments(stream: PackStream, arguments_class: type | None = None,
                                **kwargs: Any) -> transformers.TrainingArguments:
    """`TrainingArguments` (or `arguments_class`, e.g. TRL's `SFTConfig`) for training on `stream`: one
    optimizer step per Packfeed step, the stream's own resumption, and `max_steps` the job's steps unless given.
    Settings that contradict these are refused with what to do instead."""
    fixed = {"gradient_accumulation_steps": stream.info.plan.microbatches, "ignore_data_skip": True,
             "per_device_train_batch_size": 1, "dataloader_num_workers": 0, "remove_unused_columns": False}
    for name, value in fixed.items():
        if name in kwargs and kwargs[name] != value:
            raise PackfeedError(f"{name}={kwargs[name]!r} contradicts training on Packfeed steps: it must be "
                                f"{value!r} (a step is {fixed['gradient_accumulation_steps']} packs, each one batch, "
                                "and the stream itself resumes); leave it out")
    settings = {**kwargs, **fixed}
    steps, epochs = job_steps(stream), int(stream.info.epochs)
    if "num_train_epochs" in kwargs and kwargs["num_train_epochs"] != epochs:
        raise PackfeedError(f"num_train_epochs={kwargs['num_train_epochs']!r}: the job's epochs are its own "
                            f"(PackStream(epochs=...)), {epochs} here; leave it out, or open a job with that many")
    if steps and settings.get("max_steps", -1) > steps:
        raise PackfeedError(f"max_steps={settings['max_steps']} is past the job's {steps} steps ({epochs} epoch(s) of "
                            f"{', '.join(map(str, stream.info.epoch_steps))}): give at most {steps}, or open a job "
                            "with more epochs")
    if settings.get("max_steps", -1) <= 0:
        if not steps:
            raise PackfeedError("the job's step count is not known yet (a windowed plan): give max_steps")
        settings["max_steps"] = steps
    return (arguments_class or transformers.TrainingArguments)(**settings)


class PackBatches:
    """This rank's packs, one Trainer batch each, as the model's keyword arguments (`to_hf_inputs`). Its length
    is the job's batches (steps x M) where the job knows its steps."""

    def __init__(self, stream: PackStream, family: str, attention: str = "sdpa", dtype: torch.dtype = torch.float32,
                 ensure_encoders: bool = False):
        self.stream, self.family, self.attention, self.dtype = stream, family, attention, dtype
        self.dp = stream.info.plan.dp
        self.ensure_encoders = ensure_encoders  # every pack calls every vision tower (sharded data parallelism)
        self.step: Step | None = None  # the step whose packs were handed out last
        # a loss-driven mixture's: the packs handed out and not yet trained, in order (each is one compute_loss)
        self.handed: collections.deque[tuple[Step, PackTensors]] | None = \
            collections.deque() if stream.loss_driven else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        conventions = self.stream.conventions
        for step in self.stream:
            self.step = step  # the Trainer takes a whole step's batches before it trains on them
            for pack in step.packs:  # an empty pack gives inputs that still join every collective
                if self.handed is not None:
                    self.handed.append((step, pack))
                yield to_hf_inputs(pack, self.family, dp=self.dp, conventions=conventions, dtype=self.dtype,
                                   attention=self.attention, ensure_encoders=self.ensure_encoders)

    def __len__(self) -> int:
        return job_batches(self.stream)  # unknown: the Trainer relies on max_steps


class PackfeedTrainerMixin:
    """Trainer methods that feed it a `PackStream` (see the module's docstring)."""

    def __init__(self, *args: Any, stream: PackStream, family: str, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32, ensure_encoders: bool | None = None,
                 skip_guard_updates: bool | None = None, **kwargs: Any):
        self.packfeed_batches = PackBatches(stream, family, attention, dtype)
        self.packfeed_losses = StepLosses()  # a loss-driven mixture's step so far (compute_loss)
        quiet_expected_accumulation_warning(stream.info.plan.microbatches)
        super().__init__(*args, **kwargs)
        self._check_arguments(stream)
        check_model(self.model, stream.conventions)  # before the first forward, not as a shape error inside it
        # sharded data parallelism gathers the vision tower's parameters on every rank that runs it: every pack
        # then runs it (to_hf_inputs' ensure_encoders), or a text-only rank would leave the others waiting
        self.packfeed_batches.ensure_encoders = sharded(self.args) if ensure_encoders is None else ensure_encoders
        self._skip_guard_updates(skip_guard_updates)

    def _skip_guard_updates(self, wanted: bool | None) -> None:
        """Steps whose towers only the guard called leave the towers as an unguarded run would (on by default
        where the optimizer allows it: not under DeepSpeed)."""
        deepspeed = getattr(self.args, "hf_deepspeed_config", None) is not None
        if wanted and deepspeed:
            raise PackfeedError("skip_guard_updates: DeepSpeed's ZeRO optimizer updates every parameter it holds, "
                                "with or without a gradient, so a step that only the guard (ensure_encoders) ran "
                                "through the vision tower still moves it; leave skip_guard_updates unset under "
                                "DeepSpeed (docs/training.md, 'FSDP and ZeRO-3 with the vision tower wrapped apart')")
        if wanted or (wanted is None and not deepspeed):
            self.add_callback(SkipGuardOnlyTowerUpdates(self.packfeed_batches))

    def _check_arguments(self, stream: PackStream) -> None:
        args, plan = self.args, stream.info.plan
        problems = []
        if args.gradient_accumulation_steps != plan.microbatches:
            problems.append(f"gradient_accumulation_steps is {args.gradient_accumulation_steps}, the job's M is "
                            f"{plan.microbatches}")
        if not args.ignore_data_skip:
            problems.append("ignore_data_skip is off: on resume the Trainer would skip steps the stream already skips")
        if args.world_size != plan.dp or args.process_index != stream.rank:
            problems.append(f"this process is rank {args.process_index} of {args.world_size}, the stream is rank "
                            f"{stream.rank} of DP {plan.dp}")
        if problems:
            raise PackfeedError("the Trainer's arguments do not match the Packfeed job: " + "; ".join(problems)
                                + ". Build them with packfeed_training_arguments(stream, ...)")

    @property
    def packfeed_step(self) -> Step | None:
        """The Packfeed step the Trainer is training on (or last trained on): its `epoch`, `step` and
        `sample_keys`, e.g. for a callback's `on_step_end`."""
        return self.packfeed_batches.step

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs in the job's terms: `epoch` is the job's epoch (its fraction done, continuous over a
        resume; the Trainer's own counts the whole job as one epoch), `packfeed_step` k of `packfeed_steps` N."""
        step = self.packfeed_batches.step
        if step is None or not job_steps(self.packfeed_batches.stream):
            return super().log(logs, *args, **kwargs)
        number, epoch = job_progress(self.packfeed_batches.stream, step)
        logs = {**logs, "packfeed_step": number, "packfeed_steps": job_steps(self.packfeed_batches.stream)}
        own = self.state.epoch  # Trainer.log writes state.epoch into the logs: the job's, for this call
        self.state.epoch = round(epoch, 4)
        try:
            super().log(logs, *args, **kwargs)
        finally:
            self.state.epoch = own

    def get_train_dataloader(self) -> PackBatches:
        """This rank's packs as the server sends them: no sampler, no Accelerate sharding, no collation."""
        return self.packfeed_batches

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """The step's loss tokens over every rank (what the Trainer would gather), or this rank's share of them
        without `average_tokens_across_devices` (DDP's gradient average then restores the global mean)."""
        if not batch_samples:
            return None
        share = batch_samples[0]["num_items_in_batch"]  # step_loss_tokens / dp, the same in every pack of the step
        count = share * self.packfeed_batches.dp if self.args.average_tokens_across_devices else share
        return count.to(device)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None) -> Any:
        """The Trainer's loss; on a loss-driven mixture also this pack's loss per dataset, read from the model's
        own outputs (its logits, or a fused LM head's log-probabilities), reported at the step's last pack."""
        batches = self.packfeed_batches
        if batches.handed is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        labels, seen = inputs.get("labels"), []
        hook = self.accelerator.unwrap_model(model).register_forward_hook(lambda _, __, out: seen.append(out))
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        finally:
            hook.remove()
        step, pack = batches.handed.popleft()
        if not pack.empty:
            self.packfeed_losses.add(pack, *outputs_token_losses(seen, labels))
        if pack is step.packs[-1]:
            self.packfeed_losses.report(batches.stream, step)
        return result

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=self.packfeed_batches.stream.rank))
        with open(path, "w") as out:
            json.dump(self.packfeed_batches.stream.state_dict(), out)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """The checkpoint's weights through the model class's own loader. transformers 5 saves VLMs under their
        legacy key names (`visual.*`, `model.layers.*`) and its Trainer loads them back with a non-strict
        `load_state_dict` that renames nothing: every weight keeps its initial value, silently. `from_pretrained`
        renames them; the copy it makes is loaded strictly into the model, then dropped."""
        if not load_weights_strictly(self.model if model is None else model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """`Trainer.train`, the stream first moved to the step after the checkpoint's."""
        stream = self.packfeed_batches.stream
        resume_from_checkpoint, saved = saved_state(resume_from_checkpoint, self.args.output_dir,
                                                    STATE_FILE.format(rank=stream.rank), "PackfeedTrainer")
        if saved is not None:
            stream.load_state_dict(saved)
        return super().train(resume_from_checkpoint, *args, **kwargs)


def outputs_token_losses(outputs: list[Any], labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position losses of a pack's row from what its forward returned (the last output with them)."""
    for out in reversed(outputs):
        if getattr(out, "logits", None) is not None and labels is not None:
            return token_losses(out.logits[0], labels[0].to(out.logits.device))
        if getattr(out, "log_probs", None) is not None and getattr(out, "label_mask", None) is not None:
            return fused_token_losses(out.log_probs[0], out.label_mask[0])
    raise PackfeedError("the job's mixture is loss-driven, and the model's outputs carry neither logits nor a fused "
                        "LM head's log_probs: report the per-dataset losses yourself (PackStream.report, "
                        "packfeed.client.model.dataset_losses)")


def saved_state(resume_from_checkpoint: str | bool | None, output_dir: str, state_file: str,
                saved_by: str) -> tuple[str | bool | None, Any]:
    """(the checkpoint `Trainer.train` resumes from, the Packfeed state `state_file` saved in it; None when not
    resuming). `True`: the last checkpoint in `output_dir`. A checkpoint without the file is refused: where the
    streams stood is unknown."""
    if resume_from_checkpoint is True:
        resume_from_checkpoint = get_last_checkpoint(output_dir)
        if resume_from_checkpoint is None:
            raise ValueError(f"no valid checkpoint found in output directory ({output_dir})")
    if not resume_from_checkpoint:
        return resume_from_checkpoint, None
    path = os.path.join(resume_from_checkpoint, state_file)
    if not os.path.isfile(path):
        raise PackfeedError(f"{path} is missing: this checkpoint was not saved by a {saved_by}, so where its streams "
                            "stood is unknown; resume from one that was, or start the job afresh")
    with open(path) as state:
        return resume_from_checkpoint, json.load(state)


def load_weights_strictly(target: torch.nn.Module, folder: str) -> bool:
    """Load a Trainer checkpoint's weights into `target` through its class's `from_pretrained` (see
    `PackfeedTrainerMixin._load_from_checkpoint`); False where they are not a `PreTrainedModel`'s safetensors."""
    saved = [os.path.join(folder, name) for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)]
    if not isinstance(target, transformers.PreTrainedModel) or not any(map(os.path.isfile, saved)):
        return False
    dtype = next(target.parameters()).dtype
    loaded = type(target).from_pretrained(folder, attn_implementation="sdpa", dtype=dtype)
    target.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    return True


class _ExpectedAccumulationMismatch(logging.Filter):
    """Under DeepSpeed, Accelerate warns "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,
    DeepSpeed config has M. Using DeepSpeed's value." for every Trainer with M > 1: the Trainer accumulates
    itself and gives Accelerate 1 on purpose, and DeepSpeed's M (the job's) is the right one. Only that case is
    dropped; any other mismatch still shows."""

    def __init__(self, microbatches: int):
        super().__init__()
        self.expected = f"GradientAccumulationPlugin has 1, DeepSpeed config has {microbatches}."

    def filter(self, record: logging.LogRecord) -> bool:
        return self.expected not in record.getMessage()


def quiet_expected_accumulation_warning(microbatches: int) -> None:
    logger, quiet = logging.getLogger("accelerate.accelerator"), _ExpectedAccumulationMismatch(microbatches)
    if not any(getattr(f, "expected", None) == quiet.expected for f in logger.filters):
        logger.addFilter(quiet)


def sharded(args: transformers.TrainingArguments) -> bool:
    """Whether the Trainer shards parameters layer by layer over the ranks: DeepSpeed ZeRO-3, or FSDP."""
    if args.fsdp:
        return True
    config = getattr(args, "hf_deepspeed_config", None)
    return bool(config is not None and config.is_zero3())


class PackfeedTrainer(PackfeedTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` trained on a `PackStream`'s packs."""
