"""TRL's `SFTTrainer` fed by a `PackStream`: `pip install packfeed[trl]`.

    config = packfeed_sft_config(stream, output_dir="out", learning_rate=1e-5, save_steps=500)
    trainer = PackfeedSFTTrainer(model=model, args=config, stream=stream, family="qwen2_vl")
    trainer.train(resume_from_checkpoint=True)

Everything `PackfeedTrainer` does (packfeed.client.frameworks.hf_trainer), where SFTTrainer differs:
- It requires a dataset and prepares (tokenizes, truncates, packs) it in its constructor. Packfeed's packs are
  already tokenized and packed with their images, so preparation is skipped (`skip_prepare_dataset`) and the
  dataset is a one-row placeholder the Trainer never reads: the packs come from `get_train_dataloader`.
- Its loss comes from its fused LM head (log-probabilities of the labels, summed over the microbatch and
  divided by `num_items_in_batch`), so the step's loss tokens normalise it exactly as they do the Trainer's.
- Its `max_length` truncation and `packing` options do not apply: packs arrive planned and never longer than the
  job's token cap.
- Its `num_tokens` metric counts the tokens of the packs trained on, over the DP ranks (SFTTrainer reads a
  padding-free batch's length from `position_ids`' second dimension, which M-RoPE's (3, 1, L) makes 1 a pack).
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from packfeed.client.frameworks.hf_trainer import PackfeedTrainerMixin, packfeed_training_arguments
from packfeed.client.stream.pack_stream import PackStream


def packfeed_sft_config(stream: PackStream, **kwargs: Any) -> SFTConfig:
    """`SFTConfig` for training on `stream` (see `packfeed_training_arguments`), dataset preparation skipped."""
    kwargs["dataset_kwargs"] = {**kwargs.get("dataset_kwargs", {}), "skip_prepare_dataset": True}
    return packfeed_training_arguments(stream, SFTConfig, **kwargs)


class PackfeedSFTTrainer(PackfeedTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` trained on a `PackStream`'s packs."""

    def __init__(self, *args: Any, stream: PackStream, family: str, **kwargs: Any):
        if kwargs.get("train_dataset") is not None:
            raise ValueError("the packs come from the stream: leave train_dataset out")
        kwargs["train_dataset"] = Dataset.from_dict({"input_ids": [[0]], "labels": [[0]]})  # never read
        super().__init__(*args, stream=stream, family=family, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        counted = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self._total_train_tokens != counted:  # a training step's pack: its tokens, not its rows
            local = torch.tensor(inputs["input_ids"].shape[-1], device=inputs["input_ids"].device)
            self._total_train_tokens = counted + int(self.accelerator.gather_for_metrics(local).sum().item())
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result
