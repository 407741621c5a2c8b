"""The faces to the trainers people run, each over the stream and the model rooms: the HF `Trainer`
(`hf_trainer.PackfeedTrainer`) and TRL's SFT (`sft_trainer`) and GRPO (`trl`, with its prompts, its rollouts, vLLM
colocated with each rank and the checks of its config: `grpo_prompts`, `grpo_rollouts`, `trl_vllm`,
`grpo_config`), Lightning (`lightning`), Megatron (`megatron`). verl's face runs the planner on verl's driver,
which the client may not import: it stands with the command line (`packfeed.cli.verl_ppo`,
`packfeed.cli.verl_batches`)."""
