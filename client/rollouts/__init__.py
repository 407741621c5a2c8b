"""The rollout side of reinforcement learning: what a rollout process needs beside its `Producer` (weights that
reach it by version, `weights`)."""
