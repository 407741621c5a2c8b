"""A vLLM producer of an asynchronous GRPO run (tests/vllm_rollouts_check.py starts two, in vLLM's own
environment): a `RolloutWorker` on the prompt job's share of consumer INDEX of 2, each group reserved first
(staleness wait) and generated with the version its grant names, loaded from the trainer's `WeightVersions`. The
engine: vLLM's `LLM` in this process, or with SERVER_URL the vLLM server there (`VLLMServerEngine`).

    python vllm_producer.py TARGET MODEL_DIR WEIGHTS OUT INDEX STEPS [SERVER_URL]

Writes OUT/producer-{INDEX}.json: the engine, the versions it loaded, and its prompt steps and rollouts put.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from packfeed.client import Producer  # noqa: E402
from packfeed.client.rollouts.engine_io import Sampling  # noqa: E402
from packfeed.client.rollouts.prompts import prompt_job_stream  # noqa: E402
from packfeed.client.rollouts.weights import WeightVersions  # noqa: E402
from packfeed.client.rollouts.worker import RolloutWorker  # noqa: E402

ASYNC_JOB, GENERATIONS = "async", 4


def reward(completions, **_):
    return [float(len(set(c))) for c in completions]  # distinct characters: rewards differ within a group


def main() -> None:
    target, model_dir, weights, out, index, steps = sys.argv[1:7]
    if len(sys.argv) > 7:
        from packfeed.client.rollouts.vllm_server import VLLMServerEngine

        engine, kind = VLLMServerEngine(sys.argv[7], tokenizer=Path(model_dir, "tokenizer.json")), "server"
    else:
        from packfeed.client.rollouts.vllm_engine import VLLMEngine

        engine, kind = VLLMEngine.from_pretrained(model_dir, dtype="float32", max_model_len=512, enforce_eager=True,
                                                  limit_mm_per_prompt={"image": 4}, seed=int(index)), "offline"
    prompts = prompt_job_stream(target, ASYNC_JOB, consumers=2, consumer=int(index), per_consumer=1)
    producer = Producer(target, job=f"{ASYNC_JOB}-rollouts", name=f"vllm-{index}", heartbeat_s=1.0,
                        open_wait_s=600, full_wait_s=600)
    worker = RolloutWorker(engine, prompts, producer, [reward], family="qwen2_vl", weights=WeightVersions(weights),
                           generations=GENERATIONS, reserve=True,
                           sampling=Sampling(max_tokens=8, temperature=1.0, seed=int(index)))
    report = worker.run(steps=int(steps))
    worker.close()
    record = {"engine": kind, "loaded": report.versions, "steps": report.steps, "rollouts": report.rollouts}
    Path(out, f"producer-{index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
