"""PyTorch Lightning fed by Packfeed: `PackDataModule`, a `LightningDataModule` whose stream position goes into
Lightning's checkpoints. `pip install packfeed[lightning]`.

    data = PackDataModule("loader:50051", job="sft", family="qwen2_vl", microbatches=4, epochs=2)
    trainer = lightning.Trainer(accumulate_grad_batches=4, max_epochs=1, strategy="ddp_find_unused_parameters_true")
    trainer.fit(module, datamodule=data, ckpt_path="last")

    class Module(lightning.LightningModule):
        def training_step(self, batch, batch_idx):
            # Lightning divides the loss by accumulate_grad_batches; the batch is already normalised by the step's
            # loss tokens (num_items_in_batch), so undo that division
            return self.model(**batch).loss * self.trainer.accumulate_grad_batches

- One Lightning epoch is the whole job (`max_epochs=1`): the job's own epochs are the stream's (`epochs=`).
- The stream opens in `setup()`, on every process, as rank `trainer.global_rank` of DP `trainer.world_size`.
- Each batch is one pack (with `family`, the model's keyword arguments from `to_hf_inputs`; without, the
  `PackTensors`), never collated, padded or re-sharded: Lightning's distributed sampler only wraps DataLoaders,
  and none is made. `accumulate_grad_batches` must be the job's M: one optimizer step per Packfeed step.
- `state_dict()` gathers every rank's stream position (Lightning writes the checkpoint from rank 0 alone), and
  `load_state_dict()` gives each rank its own: `fit(ckpt_path=...)` continues at exactly the next step. The
  batches' iterable tells Lightning it is resumable (so it does not warn that a mid-epoch resume "can cause
  unreliable results": the data module restores the position itself).
- The job's terms: `data.packfeed_step` is the step being trained (its `epoch`, `step`, `sample_keys`);
  `callbacks=[PackProgress()]` logs `packfeed_epoch` (the job's, with its fraction done) and `packfeed_step`
  k of `packfeed_steps` N with every optimizer step. `max_steps` past the job's last step is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning
import torch.distributed as dist

from packfeed.client.stream.channel import PackfeedError
from packfeed.client.model.hf import check_model, to_hf_inputs
from packfeed.client.stream.loaders import StatefulPackLoader, job_batches, job_progress, job_steps
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import Step


class PackBatchIterable:
    """This rank's packs, one batch each. No `state_dict`: the data module owns the position, for every rank. Its
    length is the job's batches (all its epochs: one Lightning epoch is the whole job), where the job knows its
    steps; Lightning needs it to resume mid-epoch (without one it takes every batch for the last)."""

    def __init__(self, stream: PackStream, family: str | None):
        self.stream, self.family = stream, family
        self.step: Step | None = None  # the step whose packs were handed out last

    def __iter__(self) -> Iterator[Any]:
        dp = self.stream.info.plan.dp
        for step in self.stream:
            self.step = step
            for pack in step.packs:
                if not self.family:
                    yield pack
                else:
                    yield to_hf_inputs(pack, self.family, dp=dp, conventions=self.stream.conventions)

    def __len__(self) -> int:
        return job_batches(self.stream)

    def state_dict(self) -> dict[str, Any]:  # resumable as far as Lightning can tell: the data module restores it
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PackDataModule(lightning.LightningDataModule):
    """A Packfeed job as Lightning's training data. `target`, `job` and `stream_options` go to `PackStream`
    (rank and dp come from the Lightning trainer); `family`: batches as that HF family's model inputs."""

    def __init__(self, target: str | list[str], *, job: str, family: str | None = None, **stream_options: Any):
        super().__init__()
        self.target, self.job, self.family, self.stream_options = target, job, family, stream_options
        self.stream: PackStream | None = None
        self._pending: dict[str, Any] | None = None  # a state loaded before setup() opened the stream
        self._batches: PackBatchIterable | None = None

    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        trainer = self.trainer
        self.stream = PackStream(self.target, job=self.job, rank=trainer.global_rank, dp=trainer.world_size,
                                 **self.stream_options)
        microbatches = self.stream.info.plan.microbatches
        if trainer.accumulate_grad_batches != microbatches:
            raise PackfeedError(f"accumulate_grad_batches is {trainer.accumulate_grad_batches}, the job's M is "
                                f"{microbatches}: give lightning.Trainer(accumulate_grad_batches={microbatches}), "
                                "one optimizer step per Packfeed step")
        if self._pending is not None:
            StatefulPackLoader(self.stream).load_state_dict(self._pending)

    @property
    def packfeed_step(self) -> Step | None:
        """The Packfeed step being trained (or last trained): `epoch`, `step`, `sample_keys`."""
        return self._batches.step if self._batches is not None else None

    def train_dataloader(self) -> PackBatchIterable:
        """Asked for once the module's model exists (after `configure_model`), before the first forward: a
        Hugging Face model in it whose vocabulary or placeholder ids disagree with the dataset is refused here."""
        if self.family:
            hf = next((m for m in self.trainer.lightning_module.modules() if hasattr(m, "get_input_embeddings")
                       and hasattr(m, "config")), None)  # the outermost transformers model
            if hf is not None:
                check_model(hf, self.stream.conventions)
        steps = job_steps(self.stream)
        if steps and self.trainer.max_steps > steps:
            raise PackfeedError(f"max_steps={self.trainer.max_steps} is past the job's {steps} steps: give at most "
                                f"{steps}, or open a job with more epochs")
        self._batches = PackBatchIterable(self.stream, self.family)
        return self._batches

    def teardown(self, stage: str) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def state_dict(self) -> dict[str, Any]:
        """Every rank's `StatefulPackLoader` state merged: {"dp_rank_<r>": rank r's position, ..., "world_size":
        DP}. A collective: Lightning calls it on every rank when it saves."""
        if self.stream is None:
            return {}
        state = StatefulPackLoader(self.stream).state_dict()
        states = [state]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        return {key: value for entry in states for key, value in entry.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue every rank at exactly the step after the checkpoint's."""
        if not state:
            return
        if self.stream is None:
            self._pending = state
        else:
            StatefulPackLoader(self.stream).load_state_dict(state)


class PackProgress(lightning.Callback):
    """Logs the job's progress with every optimizer step: `packfeed_epoch` (the job's epoch and the fraction of it
    done), `packfeed_step` (k, from 1) and `packfeed_steps` (N). Lightning's own epoch is the whole job."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        data = trainer.datamodule
        step = getattr(data, "packfeed_step", None)
        if step is None or not job_steps(data.stream):
            return
        number, epoch = job_progress(data.stream, step)
        pl_module.log_dict({"packfeed_epoch": epoch, "packfeed_step": float(number),
                            "packfeed_steps": float(job_steps(data.stream))}, on_step=True, on_epoch=False)
