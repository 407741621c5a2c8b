"""GRPO post-training with TRL's `GRPOTrainer` on Packfeed: prompts from a Packfeed job, rollouts through a live job.

    packfeed demo --out demo-out --dataset-only --samples 64
    packfeed index 'demo-out/shards/*.tar' --tokenizer demo-out/tokenizer.json --preset qwen2_vl \\
        --extend-tokenizer --max-pixels 200704 --out qwen2_vl/index.parquet
    packfeed serve --index qwen2_vl/index.parquet --listen 127.0.0.1:50052 --live-spool grpo-spool &
    torchrun --nproc-per-node 2 examples/trl_grpo.py 127.0.0.1:50052 grpo-out --steps 3

Each step, every rank takes its prompts from the job `grpo-example-prompts` (the same number on each rank,
balanced on their tokens, images decoded), TRL generates G = 2 completions each and scores them with `reward`
below, rank 0 puts the scored rollouts into the live job `grpo-example-rollouts`, and every rank trains its
balanced, group-aware packs of it (each prompt computed once for its completions) with TRL's loss. One JSON line a
step: `step`, `loss`, `reward`. The model is a small randomly initialised Qwen2-VL sized from the dataset's
conventions so that this runs on a CPU; for a real one, load it with `from_pretrained` and index the prompts with
its preset and tokenizer. A run is one job: give another `--job` (or a fresh spool) to run it again.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import PreTrainedTokenizerFast, PrinterCallback, Qwen2VLForConditionalGeneration, TrainerCallback
from trl import GRPOConfig

from packfeed.client.model.hf import model_config
from packfeed.client.frameworks.trl import PackfeedGRPOTrainer, prompt_stream

SIZES = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}}


def reward(completions: list[str], solution: list[str], **kwargs) -> list[float]:
    """The share of a completion's characters found in the reference answer (the prompt's indexed answer is
    `solution`): a score that differs within a group even for a random model."""
    return [len(set(c) & set(s)) / max(len(set(c)), 1) for c, s in zip(completions, solution)]


class JsonLines(TrainerCallback):
    """One JSON line a step on rank 0: its step, loss and mean reward."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(json.dumps({"step": state.global_step, "loss": logs["loss"], "reward": logs.get("reward")}),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Packfeed server (started with --live-spool), host:port")
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (each one generation)")
    parser.add_argument("--job", default="grpo-example", help="the run's jobs are JOB-prompts and JOB-rollouts")
    parser.add_argument("--tokenizer", default="qwen2_vl/tokenizer.json", help="the dataset's tokenizer")
    options = parser.parse_args()
    config = GRPOConfig(output_dir=options.output_dir, max_steps=options.steps, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=8, learning_rate=1e-4,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                        bf16=torch.cuda.is_available(), disable_tqdm=True)
    prompts = prompt_stream(options.target, options.job, config)
    model = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", prompts.conventions, **SIZES))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=options.tokenizer, eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    trainer = PackfeedGRPOTrainer(model=model, reward_funcs=[reward], args=config, processing_class=tokenizer,
                                  target=options.target, job=options.job, family="qwen2_vl", prompts=prompts,
                                  callbacks=[JsonLines()])
    trainer.remove_callback(PrinterCallback)  # stdout: the JSON lines alone
    trainer.train()
    # the ranks leave together, the process group torn down: a rank whose interpreter exits while gloo's threads
    # still serve the other can abort at teardown ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
