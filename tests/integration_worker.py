"""A DP rank under torchrun (gloo) training a tiny Qwen2-VL on a Packfeed job, either in a plain `PackStream`
loop (DDP, SGD, clipping: what a hand-written loop does), with `PackfeedTrainer` (`transformers.Trainer`) or
TRL's `SFTTrainer`, or with Lightning and `PackDataModule`.
Writes the sample keys of the steps it trained and the global loss of each step to OUT/rank<r>.json.

    torchrun --nproc-per-node 2 tests/integration_worker.py TARGET JOB MODE STEPS CHECKPOINTS OUT

MODE: plain; train (STEPS steps, a checkpoint every 2); sft (the same with TRL's SFTTrainer); resume (from CHECKPOINTS/checkpoint-2 up to STEPS);
control (the same resume with the stream's state not loaded: the Trainer's own resume alone); lightning-train,
lightning-resume, lightning-control (the same with Lightning; the control loads no data module state)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from packfeed.client import PackStream
from packfeed.client.model.hf import to_hf_inputs
from packfeed.client.frameworks.hf_trainer import PackBatches, PackfeedTrainer, packfeed_training_arguments
from packfeed.trainer.models.hf.build import build_hf_model
from hf_models import tiny_sizes

# SGD: Adam divides by the gradients' magnitude, so it would magnify the last-digit differences of two loss
# implementations (TRL's fused LM head against the model's own) into visible ones within a few steps
FAMILY, LR, CLIP = "qwen2_vl", 0.01, 1.0
SIZES = tiny_sizes(FAMILY)


def plain(stream: PackStream, steps: int) -> tuple[list, list]:
    """The hand-written loop the integration must equal."""
    model = torch.nn.parallel.DistributedDataParallel(build_hf_model(FAMILY, stream.conventions, SIZES),
                                                      find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    keys, losses = [], []
    for _, step in zip(range(steps), stream):
        total = 0.0
        for pack in step.packs:
            loss = model(**to_hf_inputs(pack, FAMILY, dp=stream.info.plan.dp, conventions=stream.conventions)).loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        summed = torch.tensor([total])
        dist.all_reduce(summed)
        keys.append(step.sample_keys)
        losses.append(float(summed) / stream.info.plan.dp)  # each rank's loss is its share of the step's mean
    return keys, losses


class RecordingBatches(PackBatches):
    """PackBatches that remember the sample keys of each step they hand out."""

    keys: list = []
    tokens: list = []  # each step's tokens trained on (its packs' lengths)
    num_tokens: list = []  # the trainer's own count, as logged
    ensure_encoders = False  # as the Trainer set it (on for DeepSpeed ZeRO-3)

    def __iter__(self):
        for step in self.stream:
            self.keys.append(step.sample_keys)
            inputs = [to_hf_inputs(pack, self.family, dp=self.dp, conventions=self.stream.conventions,
                                   ensure_encoders=self.ensure_encoders) for pack in step.packs]
            self.tokens.append(sum(int(one["input_ids"].shape[-1]) for one in inputs))
            yield from inputs


def with_trainer(stream: PackStream, steps: int, checkpoints: str, mode: str) -> tuple[list, list]:
    settings = dict(output_dir=checkpoints, max_steps=steps, save_steps=2, logging_steps=1, learning_rate=LR,
                    weight_decay=0.0, max_grad_norm=CLIP, lr_scheduler_type="constant", optim="sgd",
                    report_to=[], use_cpu=True, disable_tqdm=True)
    model = build_hf_model(FAMILY, stream.conventions, SIZES)
    if mode.startswith("zero3"):  # DeepSpeed ZeRO-3 (its CPU accelerator, gloo): parameters sharded over the ranks
        # the docs' whole config (examples/ds_zero3.json); this test's SGD is one DeepSpeed has not tested
        config = json.loads((Path(__file__).parents[1] / "examples" / "ds_zero3.json").read_text())
        settings["deepspeed"] = {**config, "zero_allow_untested_optimizer": True}
        mode = mode.removeprefix("zero3-")
    if mode == "sft":
        from packfeed.client.frameworks.sft_trainer import PackfeedSFTTrainer, packfeed_sft_config

        # the user's own processor in practice; here the dataset's tokenizer, its first token the pad token
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=os.environ["PACKFEED_TEST_TOKENIZER"])
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
        trainer = PackfeedSFTTrainer(model=model, args=packfeed_sft_config(stream, **settings), stream=stream,
                                     family=FAMILY, processing_class=tokenizer)
    else:
        trainer = PackfeedTrainer(model=model, args=packfeed_training_arguments(stream, **settings), stream=stream,
                                  family=FAMILY)
    recording = RecordingBatches(stream, FAMILY)
    recording.ensure_encoders = RecordingBatches.ensure_encoders = trainer.packfeed_batches.ensure_encoders
    trainer.packfeed_batches = recording
    checkpoint = f"{checkpoints}/checkpoint-2"
    if mode in ("train", "sft"):
        trainer.train()
    elif mode == "resume":
        trainer.train(resume_from_checkpoint=checkpoint)
    else:  # control: the Trainer's own resume (model, optimizer, its step count), the stream not moved
        transformers.Trainer.train(trainer, resume_from_checkpoint=checkpoint)
    RecordingBatches.num_tokens = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
    return RecordingBatches.keys, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def with_lightning(target: str, job: str, steps: int, checkpoints: str, mode: str) -> tuple[list, list]:
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from packfeed.client.frameworks.lightning import PackBatchIterable, PackDataModule

    keys: list = []

    class Recording(PackBatchIterable):
        def __iter__(self):
            for step in self.stream:
                keys.append(step.sample_keys)
                for pack in step.packs:
                    yield to_hf_inputs(pack, FAMILY, dp=self.stream.info.plan.dp, conventions=self.stream.conventions)

    class Data(PackDataModule):
        def train_dataloader(self):
            return Recording(self.stream, self.family)

        def load_state_dict(self, state):
            if mode != "lightning-control":  # the control: Lightning restores all but the data
                super().load_state_dict(state)

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses, self.summed = None, [], 0.0

        def configure_model(self):  # the conventions are known once the data module has opened its stream
            if self.model is None:
                self.model = build_hf_model(FAMILY, self.trainer.datamodule.stream.conventions, SIZES)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.summed += float(loss.detach())
            if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
                total = torch.tensor([self.summed])
                dist.all_reduce(total)
                self.losses.append(float(total) / self.trainer.world_size)
                self.summed = 0.0
            return loss * self.trainer.accumulate_grad_batches  # Lightning divides by it; the loss is normalised

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    data = Data(target, job=job, family=FAMILY, microbatches=2, seed=0, epochs=2)
    saving = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=steps,
                                max_epochs=1, strategy=DDPStrategy(find_unused_parameters=True, process_group_backend="gloo"),
                                accumulate_grad_batches=2, gradient_clip_val=CLIP, callbacks=[saving], logger=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = Module()
    trainer.fit(module, datamodule=data,
                ckpt_path=None if mode == "lightning-train" else f"{checkpoints}/epoch=0-step=2.ckpt")
    return keys, module.losses


def main(target: str, job: str, mode: str, steps: int, checkpoints: str, out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode.startswith("lightning"):
        keys, losses = with_lightning(target, job, steps, checkpoints, mode)
    else:
        if mode == "plain":
            dist.init_process_group("gloo")
        with PackStream(target, job=job, rank=rank, dp=world, microbatches=2, seed=0, epochs=2) as stream:
            keys, losses = plain(stream, steps) if mode == "plain" else with_trainer(stream, steps, checkpoints, mode)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"keys": keys, "losses": losses,
                                                         "ensure_encoders": RecordingBatches.ensure_encoders,
                                                         "tokens": RecordingBatches.tokens,
                                                         "num_tokens": RecordingBatches.num_tokens}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
