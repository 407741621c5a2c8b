"""A DP rank under torchrun (gloo) training a tiny Qwen2-VL on a Packfeed job, either in a plain `PackStream`
loop (DDP, AdamW, clipping: what a hand-written loop does) or with `PackfeedTrainer` (`transformers.Trainer`).
Writes the sample keys of the steps it trained and the global loss of each step to OUT/rank<r>.json.

    torchrun --nproc-per-node 2 tests/hf_trainer_worker.py TARGET JOB MODE STEPS CHECKPOINTS OUT

MODE: plain; train (STEPS steps, a checkpoint every 2); resume (from CHECKPOINTS/checkpoint-2 up to STEPS);
control (the same resume with the stream's state not loaded: the Trainer's own resume alone)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from packfeed.client import PackStream
from packfeed.client.hf import to_hf_inputs
from packfeed.client.hf_trainer import PackBatches, PackfeedTrainer, packfeed_training_arguments
from packfeed.trainer.models.hf.build import build_hf_model
from hf_models import tiny_sizes

FAMILY, LR, CLIP = "qwen2_vl", 1e-3, 1.0
SIZES = tiny_sizes(FAMILY)


def plain(stream: PackStream, steps: int) -> tuple[list, list]:
    """The hand-written loop the integration must equal."""
    model = torch.nn.parallel.DistributedDataParallel(build_hf_model(FAMILY, stream.conventions, SIZES),
                                                      find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
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

    def __iter__(self):
        for step in self.stream:
            self.keys.append(step.sample_keys)
            for pack in step.packs:
                yield to_hf_inputs(pack, self.family, dp=self.dp, conventions=self.stream.conventions)


def with_trainer(stream: PackStream, steps: int, checkpoints: str, mode: str) -> tuple[list, list]:
    args = packfeed_training_arguments(stream, output_dir=checkpoints, max_steps=steps, save_steps=2,
                                       logging_steps=1, learning_rate=LR, weight_decay=0.0, max_grad_norm=CLIP,
                                       lr_scheduler_type="constant", optim="adamw_torch", report_to=[],
                                       use_cpu=True, save_only_model=False, disable_tqdm=True)
    trainer = PackfeedTrainer(model=build_hf_model(FAMILY, stream.conventions, SIZES), args=args, stream=stream,
                              family=FAMILY)
    trainer.packfeed_batches = RecordingBatches(stream, FAMILY)
    checkpoint = f"{checkpoints}/checkpoint-2"
    if mode == "train":
        trainer.train()
    elif mode == "resume":
        trainer.train(resume_from_checkpoint=checkpoint)
    else:  # control: the Trainer's own resume (model, optimizer, its step count), the stream not moved
        transformers.Trainer.train(trainer, resume_from_checkpoint=checkpoint)
    return RecordingBatches.keys, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(target: str, job: str, mode: str, steps: int, checkpoints: str, out: str) -> None:
    if mode == "plain":
        dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with PackStream(target, job=job, rank=rank, dp=world, microbatches=2, seed=0, epochs=2) as stream:
        keys, losses = plain(stream, steps) if mode == "plain" else with_trainer(stream, steps, checkpoints, mode)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"keys": keys, "losses": losses}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
