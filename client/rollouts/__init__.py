"""The rollout side of reinforcement learning: the run's prompts (`prompts`), what goes into an inference engine and
what comes out (`engine_io`), vLLM's `LLM` as one (`vllm_engine`) and a vLLM server over HTTP (`vllm_server`),
generation that follows newer weights as it goes (`interruptible`), a worker that feeds an engine from the prompt
job and puts its scored rollouts into the live job (`worker`), and the policy's weights by version (`weights`)."""
