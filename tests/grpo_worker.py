"""One rank of a GRPO run under torchrun (gloo, CPU), for tests/test_trl_grpo.py.

    python -m torch.distributed.run --nproc-per-node 2 grpo_worker.py MODE TARGET JOB MODEL_DIR TOKENIZER OUT

MODE:
- `packfeed`: `PackfeedGRPOTrainer`, TRL generating and scoring; each step's scored batch (TRL's own dict) is
  recorded to OUT/batch-s{step}-r{rank}.pt, so another run can train on the very same rollouts.
- `trl`: TRL's own `GRPOTrainer` trained on OUT's recorded batches (set by PACKFEED_TEST_RECORDED), in the same
  order: TRL's loss, TRL's reference log-probabilities, TRL's step.
- `kill`: as `packfeed`, checkpointing every step and dying (os._exit) once step 2's checkpoint is written.
- `resume`: as `packfeed`, resumed from OUT's last checkpoint.
- `zero3` / `fsdp`: as `packfeed` under DeepSpeed ZeRO-3 / FSDP, the vision tower wrapped apart.
- `mixture`: as `packfeed` with prompts from the server's loss-driven mixture `mix` in windows of
  PACKFEED_TEST_WINDOW, rewarded by dataset (`easy-` keys score higher); each rank writes the rewards its reward
  function returned, step by step, to OUT/rewards-r{rank}.json.

Writes OUT/rank{r}.json: the logged losses by step, and (rank 0) OUT/params.pt, the trained weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerFast, Qwen2VLForConditionalGeneration, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from packfeed.client.frameworks.trl import PackfeedGRPOTrainer

STEPS, GENERATIONS = 4, 2


def reward(completions, solution, **kwargs):
    """Characters of the reference answer the completion uses: a score with a spread within each group."""
    return [len(set(c) & set(s)) / (1 + len(set(c))) for c, s in zip(completions, solution)]


class RewardsByDataset:
    """A reward that depends on the prompt's dataset (the easy one scores higher), recording what it returns by step
    and prompt key."""

    def __init__(self):
        self.steps: list[dict[str, list[float]]] = []

    def __call__(self, completions, solution, key, **kwargs):
        given = [(1.0 if k.startswith("easy-") else 0.0) + r for k, r in zip(key, reward(completions, solution))]
        step: dict[str, list[float]] = {}
        for k, r in zip(key, given):
            step.setdefault(k, []).append(r)
        self.steps.append(step)
        return given


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


class DieAfterCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 2:
            dist.barrier()
            os._exit(0)


def config(out: Path, mode: str) -> GRPOConfig:
    settings = dict(output_dir=str(out / "checkpoints"), per_device_train_batch_size=4, num_generations=GENERATIONS,
                    max_completion_length=6, max_steps=int(os.environ.get("PACKFEED_TEST_STEPS", STEPS)), learning_rate=0.5,
                    optim="sgd", beta=float(os.environ.get("PACKFEED_TEST_BETA", 0.04)),
                    logging_steps=1, save_strategy="steps" if mode in ("kill", "resume") else "no", save_steps=1,
                    report_to=[], seed=7, use_cpu=True, lr_scheduler_type="constant", disable_tqdm=True,
                    temperature=1.0, epsilon_high=0.28, bf16=False)
    if mode == "mixture":  # one epoch of the prompt mixture's windows
        settings["num_train_epochs"] = 1
    if mode == "trl":  # TRL's batches leave the vision tower unused on a rank without images: DDP must know
        settings["ddp_find_unused_parameters"] = True
    if mode == "zero3":
        settings["deepspeed"] = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True}
        settings["beta"] = 0.0
    if mode == "fsdp":
        settings.update(fsdp="full_shard", beta=0.0, fsdp_config={
            "transformer_layer_cls_to_wrap": ["Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"]})
    return GRPOConfig(**settings)


def tokenizer(path: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|im_end|>", pad_token="<|im_end|>")


class Recording(PackfeedGRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
                   self.recorded / f"batch-s{self.state.global_step}-r{self.args.process_index}.pt")
        return batch


    def _next_rollout_step(self):
        packs = super()._next_rollout_step()
        shown = [{"keys": pack.sample_keys, "shared": bool("shared_prefix" in pack.tensors
                                                           and (pack.shared_prefix[:, 1] > 0).any())}
                 for pack in packs]
        (self.recorded / f"packs-s{self.state.global_step}-r{self.args.process_index}.json").write_text(json.dumps(shown))
        return packs


class Replaying(GRPOTrainer):
    """TRL's own trainer, its generation replaced by the recorded batches (reference log-probabilities computed
    by TRL's own method, as its `_generate_and_score_completions` does)."""

    def _generate_and_score_completions(self, inputs):
        path = self.recorded / f"batch-s{self.state.global_step}-r{self.args.process_index}.pt"
        batch = {k: v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v
                 for k, v in torch.load(path, weights_only=False).items()}
        if self.beta != 0.0:
            with torch.no_grad():
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                batch["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.ref_model, ids, mask, batch["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size, num_images=batch.get("num_images"),
                    pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
                    mm_token_type_ids=batch.get("mm_token_type_ids"))
        return batch


def main() -> None:
    mode, target, job, model_dir, tokenizer_path, out = sys.argv[1:7]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # float64: a GRPO gradient is a sum of terms that cancel (advantages are centred per group), which magnifies
    # float32 rounding to ~1e-4 between any two summation orders, TRL's own included. The sharded modes compare no
    # losses (they check that a text-only rank does not hang) and DeepSpeed >= 0.19.8 refuses float64 parameters:
    # float32 there, whatever DeepSpeed the package index resolves
    dtype = torch.float32 if mode in ("zero3", "fsdp") else torch.float64
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa", dtype=dtype)
    losses = Losses()
    common = dict(model=model, reward_funcs=[reward], args=config(out, mode), processing_class=tokenizer(tokenizer_path),
                  callbacks=[losses] + ([DieAfterCheckpoint()] if mode == "kill" else []))
    if mode == "trl":
        from datasets import Dataset

        trainer = Replaying(train_dataset=Dataset.from_dict({"prompt": ["unused"] * 64}), **common)
        trainer.recorded = Path(os.environ["PACKFEED_TEST_RECORDED"])
    else:
        if mode == "mixture":
            common.update(reward_funcs=[RewardsByDataset()], dataset="mix",
                          prompt_window=int(os.environ["PACKFEED_TEST_WINDOW"]))
        trainer = Recording(target=target, job=job, family="qwen2_vl",
                            shared_prefix=os.environ.get("PACKFEED_TEST_SHARED", "1") == "1", **common)
        trainer.recorded = out
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    rank = trainer.args.process_index
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses.losses}))
    if mode == "mixture":
        (out / f"rewards-r{rank}.json").write_text(json.dumps(common["reward_funcs"][0].steps))
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()},
                   out / "params.pt")
    # both ranks leave together, the process group torn down: a rank exiting while gloo's threads still serve the
    # other has aborted ("terminate called without an active exception")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
