"""vLLM colocated with each rank of `PackfeedGRPOTrainer(use_vllm=True, vllm_mode="colocate")`: TRL's own
`VLLMGeneration`, except that the prompts reach vLLM exactly as the trainer sees them and the weights reach it where
TRL's sync cannot.

- **Prompts.** TRL hands vLLM each prompt's raw images, which vLLM preprocesses a second time. Here each prompt is
  the prompt job's (`packfeed.client.rollouts.engine_io.engine_request`: the index's tokens, one placeholder per
  image, and the loader server's pixel values, embedded by vLLM's own vision tower: `VLLMEngine`), so the rollouts
  and the update read one preprocessing. A prompt's G rows (TRL repeats each G times) are one request with n = G,
  seeded from the run's seed, the step and the prompt.
- **Weights.** On CUDA, TRL's own sync (each parameter loaded into vLLM's model, gathered under ZeRO-3 or FSDP).
  On a CPU, vLLM repacks linear weights for oneDNN and that load fails: the parameters, gathered the same way, go
  through vLLM's in-place `reload_weights` (`VLLMEngine.load_weights`).
- **What it refuses** (`check_vllm_config`): server mode (TRL's vLLM server takes raw images and preprocesses them
  itself: run `packfeed.client.rollouts.worker.RolloutWorker` with `VLLMServerEngine` instead, docs/live.md
  "Rollouts from inference engines"), tensor-parallel vLLM (each rank's engine generates its own prompts), sleep mode and
  structured outputs.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import ensure_master_addr_port

from packfeed.client.rollouts.engine_io import Sampling, cut_at, engine_request, placeholders_of
from packfeed.client.rollouts.vllm_engine import VLLMEngine
from packfeed.client.stream.channel import PackfeedError


class PackfeedVLLMGeneration(VLLMGeneration):
    """See the module's docstring. `trainer`: the PackfeedGRPOTrainer whose current prompts it generates for."""

    def __init__(self, trainer: Any, **kwargs: Any):
        self.trainer = trainer
        super().__init__(**kwargs)

    def _init_vllm(self) -> None:
        accelerator = self.accelerator
        # as TRL's colocated engine: one vLLM per rank, started by the trainer's own launcher
        os.environ.update(RANK=str(accelerator.process_index), LOCAL_RANK=str(accelerator.local_process_index),
                          WORLD_SIZE=str(accelerator.num_processes))
        ensure_master_addr_port()
        self.engine = VLLMEngine.from_pretrained(
            self.model.name_or_path, tensor_parallel_size=1, gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length, max_num_seqs=self.max_num_seqs, model_impl=self.model_impl,
            distributed_executor_backend="external_launcher", seed=accelerator.process_index,
            max_num_batched_tokens=4096, trust_remote_code=self.trust_remote_code)
        self.llm = self.engine.llm
        accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        if self.accelerator.device.type != "cpu":
            return super().sync_weights()
        # gathered one at a time as TRL gathers them, each copied while it is whole
        self.engine.load_weights({name: tensor.detach().clone() for name, tensor in self._iter_named_params()})

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        """TRL's generate for the trainer's current prompts (the rows of `prompts`, each prompt G times in a
        row): (prompt ids, completion ids, per-token [logprob] lists, None)."""
        rows = self.trainer._prompts
        if [p.ids for p in rows] != prompts or len(rows) % num_generations:
            raise PackfeedError("the prompts TRL generates for are not the prompt job's step: PackfeedGRPOTrainer "
                                "generates only its own prompts")
        conventions, unique = self.trainer.prompt_stream.conventions, rows[::num_generations]
        sampling = Sampling(max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                            repetition_penalty=self.repetition_penalty,
                            seed=self.trainer.args.seed * 1_000_003 + self.trainer.state.global_step,
                            stop_token_ids=tuple(sorted(placeholders_of(conventions))))
        with profiler if profiler is not None else nullcontext():
            groups = self.engine.generate([engine_request(p, conventions) for p in unique], num_generations,
                                          sampling)
        completions = [cut_at(c, placeholders_of(conventions)) for group in groups for c in group]
        self.trainer.vllm_completions += len(completions)
        return (prompts, [c.token_ids.tolist() for c in completions],
                [[[float(v)] for v in c.logprobs] for c in completions], None)


def colocated_vllm(trainer: Any, args: Any) -> PackfeedVLLMGeneration:
    """The trainer's colocated engine, built from its `GRPOConfig` as TRL builds its own."""
    return PackfeedVLLMGeneration(
        trainer, model=trainer.model, accelerator=trainer.accelerator, processing_class=trainer.processing_class,
        mode="colocate", tensor_parallel_size=1, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation, model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code, repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length, logprobs=0)

