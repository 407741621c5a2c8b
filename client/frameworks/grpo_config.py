"""What of TRL's `GRPOConfig` `PackfeedGRPOTrainer` (packfeed.client.frameworks.trl) cannot honour: refused before a run starts,
each setting named with what to give instead."""

from __future__ import annotations

from typing import Any

from trl import GRPOConfig

from packfeed.client.stream.channel import PackfeedError

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # the loss types whose normalisation is over the global step


def check_grpo_config(args: GRPOConfig) -> None:
    """Refuse what the face cannot honour, each with its field named and what to do."""
    problems = []
    if args.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={args.loss_type!r}: give one of {LOSS_TYPES} (their normalisation does not "
                        "depend on which rank trains which rollout)")
    refused = {
        "importance_sampling_level": (args.importance_sampling_level != "token", "'token'"),
        "num_iterations": (args.num_iterations != 1,
                           "1: each live step's packs are formed from that step's rollouts and trained once (a "
                           "generation trained several times, PPO's epochs, would need the step's packs again)"),
        "steps_per_generation": (args.steps_per_generation != args.gradient_accumulation_steps,
                                 "gradient_accumulation_steps: one generation an optimizer step, as a live step "
                                 "is one optimizer step"),
        "use_transformers_continuous_batching": (args.use_transformers_continuous_batching,
                                                 "False: generate_batch takes no pixel values"),
        "top_entropy_quantile": (args.top_entropy_quantile < 1.0, "1.0"),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None, "None"),
        "entropy_coef": (args.entropy_coef != 0.0, "0.0 (no entropy bonus)"),
        "use_adaptive_entropy": (args.use_adaptive_entropy, "False"),
        "sync_ref_model": (args.sync_ref_model, "False"),
        "eval_strategy": (str(args.eval_strategy) not in ("no", "IntervalStrategy.NO"), "'no'"),
        "use_transformers_paged": (args.use_transformers_paged, "False"),
        "chat_template_kwargs": (bool(args.chat_template_kwargs),
                                 "None: the prompts are the index's tokens, rendered by its chat template"),
        "shuffle_dataset": (not args.shuffle_dataset, "True: the prompt job's seeded plan orders the prompts"),
        "use_liger_kernel": (args.use_liger_kernel, "False: the update computes TRL's loss on packs"),
        "per_device_train_batch_size": (
            args.per_device_train_batch_size * args.gradient_accumulation_steps % args.num_generations != 0,
            "a value whose product with gradient_accumulation_steps is a multiple of num_generations (each rank "
            "generates for whole prompts)"),
    }
    problems += [f"{name}: give {what}" for name, (bad, what) in refused.items() if bad] + check_vllm_config(args)
    if problems:
        raise PackfeedError("GRPOConfig settings PackfeedGRPOTrainer cannot honour: " + "; ".join(problems))


def check_vllm_config(args: Any) -> list[str]:
    """What of TRL's vLLM settings the colocated engine cannot honour, each with what to give instead."""
    if not args.use_vllm:
        return []
    refused = {
        "vllm_mode": (args.vllm_mode != "colocate",
                      "'colocate': TRL's vLLM server takes each prompt's raw images and preprocesses them a second "
                      "time; to generate on a vLLM server, run Packfeed's RolloutWorker with VLLMServerEngine, "
                      "which sends it the loader server's pixel values (docs/live.md, Rollouts from inference "
                      "engines)"),
        "vllm_tensor_parallel_size": (args.vllm_tensor_parallel_size != 1,
                                      "1 (each rank's engine generates that rank's prompts)"),
        "vllm_enable_sleep_mode": (args.vllm_enable_sleep_mode, "False"),
        "vllm_structured_outputs_regex": (args.vllm_structured_outputs_regex is not None, "None"),
        "generation_kwargs": (bool(args.generation_kwargs), "None (the sampling settings are GRPOConfig's own)"),
    }
    return [f"{name}: give {what}" for name, (bad, what) in refused.items() if bad]
