"""What of TRL's `GRPOConfig` `PackfeedGRPOTrainer` (packfeed.client.frameworks.trl) cannot honour: refused before a run starts,
each setting named with what to give instead."""

from __future__ import annotations

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
        "num_iterations": (args.num_iterations != 1, "1 (each live step is trained once)"),
        "steps_per_generation": (args.steps_per_generation != args.gradient_accumulation_steps,
                                 "gradient_accumulation_steps (one generation a step)"),
        "use_vllm": (args.use_vllm, "False: generation reads the prompts' images as the model's pixel values"),
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
    problems += [f"{name}: give {what}" for name, (bad, what) in refused.items() if bad]
    if problems:
        raise PackfeedError("GRPOConfig settings PackfeedGRPOTrainer cannot honour: " + "; ".join(problems))
