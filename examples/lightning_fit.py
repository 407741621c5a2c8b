"""Train a Hugging Face VLM with PyTorch Lightning on a Packfeed job (`PackDataModule`).

    (serve a job as in examples/hf_trainer.py)
    torchrun --nproc-per-node 2 examples/lightning_fit.py 127.0.0.1:50051 lightning-out --steps 4
    torchrun --nproc-per-node 2 examples/lightning_fit.py 127.0.0.1:50051 lightning-out --steps 6 --resume

`fit(ckpt_path=...)` restores the stream of every rank with the model and optimizer: the run continues at
exactly the next step.
"""

from __future__ import annotations

import argparse
import os

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import Qwen2VLForConditionalGeneration

from packfeed.client.model.hf import model_config
from packfeed.client.frameworks.lightning import PackDataModule

SIZES = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}}
MICROBATCHES = 2


class VLM(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self) -> None:  # sized from the job's conventions, known once the stream is open
        if self.model is None:
            torch.manual_seed(0)
            conventions = self.trainer.datamodule.stream.conventions
            self.model = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", conventions, **SIZES))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.step_loss = getattr(self, "step_loss", 0.0) + float(loss)  # the packs' parts add up to the step's
        # the pack's loss is already normalised by the step's loss tokens; Lightning divides by the accumulation
        return loss * self.trainer.accumulate_grad_batches

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:  # an optimizer step: its loss
            step = self.trainer.datamodule.packfeed_step
            if self.trainer.is_global_zero:
                print(f"step {self.trainer.global_step}: epoch {step.epoch} step {step.step}, "
                      f"loss {self.step_loss:.4f}", flush=True)
            self.step_loss = 0.0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Packfeed server, host:port")
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=-1, help="optimizer steps (default: the whole job)")
    parser.add_argument("--resume", action="store_true", help="continue from output_dir/last.ckpt")
    options = parser.parse_args()
    data = PackDataModule(options.target, job="lightning-example", family="qwen2_vl", microbatches=MICROBATCHES,
                          epochs=2)
    trainer = lightning.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
                                strategy="ddp_find_unused_parameters_true", max_epochs=1, max_steps=options.steps,
                                accumulate_grad_batches=MICROBATCHES, gradient_clip_val=1.0, logger=False,
                                callbacks=[ModelCheckpoint(dirpath=options.output_dir, every_n_train_steps=2,
                                                           save_last=True)],
                                enable_progress_bar=False, num_sanity_val_steps=0)
    trainer.fit(VLM(), datamodule=data, ckpt_path="last" if options.resume else None)


if __name__ == "__main__":
    main()
