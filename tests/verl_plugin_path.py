"""Run inside verl's own environment (tests/verl_env.py; tests/test_verl.py runs it): the whole plug-in path of
`python -m packfeed.cli.verl_ppo`, as far as verl runs on a CPU. Each check prints one JSON line; a failed check
raises.

1. installed: plain `packfeed` beside verl, verl's transformers pin kept;
2. composed: the entry's Hydra config is verl's own, with the setup hook that installs Packfeed's trainers (and a
   user's own hook refused, naming why);
3. in verl's Ray process: verl's `run_ppo` on a real local Ray cluster with that config starts the TaskRunner (a
   probe in the place of verl's, which would go on to start GPU workers); there, every v1 trainer mode of verl's
   registry and the legacy trainer the TaskRunner builds are Packfeed's (and verl's own without the hook);
4. balanced: each Packfeed trainer, a real object of its class with verl's config (no workers), balances a step as
   verl's loop calls it (`self._balance_batch(batch, metrics=metrics)`): every rollout once, rows moved whole,
   each group on one rank with the prefix grouper, and a busiest rank no busier on Packfeed's cost model than
   verl's own `_balance_batch` leaves it.

    python tests/verl_plugin_path.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
import warnings
from importlib import metadata
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import yaml  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from verl.trainer import main_ppo  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainerSync  # noqa: E402

from packfeed.cli import verl_ppo  # noqa: E402
from packfeed.server.plan.rollouts import Rollouts, rollout_costs  # noqa: E402
from packfeed.v1.options import CostModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_batches import data_proto, kv_batch  # noqa: E402

DP, PROMPTS, G = 4, 8, 4
OVERRIDES = [f"actor_rollout_ref.rollout.n={G}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "+ray_kwargs.ray_init.include_dashboard=false", f"+ray_kwargs.ray_init.num_cpus={DP}",
             "+ray_kwargs.ray_init.address=local"]  # a Ray of its own, never a cluster `ray start` left here
CONFIG_DIR = str(Path(main_ppo.__file__).parent / "config")


def report(check: str, **facts) -> None:
    print(json.dumps({"check": check, **facts}), flush=True)


def installed() -> None:
    transformers = metadata.version("transformers")
    assert tuple(int(x) for x in transformers.split(".")[:2]) < (5, 11), f"verl's pin moved: {transformers}"
    report("installed", packfeed=metadata.version("packfeed"), verl=metadata.version("verl"),
           transformers=transformers)


def composed() -> None:
    entry = [sys.executable, "-m", "packfeed.cli.verl_ppo"]
    shown = subprocess.run([*entry, "--cfg", "job", *OVERRIDES], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    config = yaml.safe_load(shown.stdout)
    hook = config["ray_kwargs"]["ray_init"]["runtime_env"]["worker_process_setup_hook"]
    assert hook == "packfeed.cli.verl_ppo.install", hook
    assert config["actor_rollout_ref"]["rollout"]["n"] == G and config["trainer"]["use_v1"] is True
    refused = subprocess.run([*entry, f"+{verl_ppo.SETUP_HOOK}=mine.hook"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "sets ray_kwargs.ray_init.runtime_env" in refused.stderr, refused.stderr
    report("composed", hook=hook, refused=refused.stderr.strip().splitlines()[-1])


@ray.remote
class TaskRunnerProbe:
    """Stands where verl's TaskRunner runs, in a process Ray started: the trainers verl would build there."""

    def run(self, config) -> None:
        from verl.trainer import main_ppo_v0
        from verl.trainer.ppo.v1 import get_trainer_cls

        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        trainers = {mode: get_trainer_cls(mode).__name__ for mode in TRAINER_REGISTRY}
        trainers["legacy"] = main_ppo_v0.RayPPOTrainer.__name__
        Path(config.packfeed_probe_out).write_text(json.dumps({"pid": os.getpid(), "trainers": trainers}))


def trainers_in_rays_process(config) -> dict:
    """The trainers verl's TaskRunner process holds when verl's `run_ppo` starts it with `config`."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "probe.json"
        with open_dict(config):
            config.packfeed_probe_out = str(out)
        try:
            main_ppo.run_ppo(config, task_runner_class=TaskRunnerProbe)
        finally:
            ray.shutdown()
        probe = json.loads(out.read_text())
    assert probe["pid"] != os.getpid()
    return probe["trainers"]


def in_rays_process(config, plain_config) -> None:
    trainers = trainers_in_rays_process(config)
    wrong = {mode: name for mode, name in trainers.items() if not name.startswith("Packfeed")}
    assert not wrong and len(trainers) >= 4, trainers
    verls = trainers_in_rays_process(plain_config)  # the control: without the hook, verl's own trainers
    assert not any(name.startswith("Packfeed") for name in verls.values()), verls
    report("in_rays_process", trainers=trainers, without_the_hook=verls)


class ActorWorkers:
    """The actor's worker group as a trainer reads it: DP ranks in its dispatch."""

    def __init__(self, dp: int):
        self._dispatch_info: dict = {}
        self.dp = dp

    def _query_dispatch_info(self, role: str) -> list[int]:
        return list(range(self.dp))


def step(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt = np.repeat(rng.integers(200, 2000, PROMPTS), G)
    tokens = prompt + np.clip(rng.lognormal(np.log(600), 1.0, PROMPTS * G), 50, 4096).astype(np.int64)
    sides = np.repeat(rng.integers(4, 40, (PROMPTS, 2)), G, axis=0)
    grids = [[1, int(h), int(w)] for h, w in sides]
    uid = np.repeat(np.array([f"prompt-{p}" for p in range(PROMPTS)]), G)
    return {"tokens": tokens, "prompt": prompt, "uid": uid, "grids": grids}


def busiest(order: list[int], data: dict, images: bool, grouped: bool) -> float:
    """The busiest rank's cost, on Packfeed's cost model, of the r-th of DP equal chunks of `order`."""
    patches = np.array([np.prod(g) for g in data["grids"]], dtype=np.float64) * images
    group = np.unique(data["uid"], return_inverse=True)[1] if grouped else None
    rollouts = Rollouts(data["tokens"], data["prompt"], patches, patches ** 2, group)
    costs = []
    for chunk in np.array_split(np.asarray(order), DP):
        part = Rollouts(rollouts.tokens[chunk], rollouts.prompt[chunk], rollouts.vit_patches[chunk],
                        rollouts.vit_attn_sq[chunk], None if group is None else group[chunk])
        costs.append(rollout_costs(part, CostModel.from_shapes(), grouped)[1].sum())
    return float(max(costs))


def balanced_v1(config, data: dict) -> None:
    trainer = object.__new__(verl_ppo.V1_TRAINERS["sync"])
    trainer.config, trainer.use_critic, trainer.global_steps = config, False, 1
    trainer.tokenizer, trainer.actor_rollout_wg = types.SimpleNamespace(eos_token_id=2), ActorWorkers(DP)
    ours, theirs = kv_batch(data["tokens"], data["prompt"], data["uid"]), None
    keys_before = dict(zip(ours.keys, (tag["row"] for tag in ours.tags)))
    metrics: dict = {}
    ours = trainer._balance_batch(ours, metrics=metrics)
    theirs = PPOTrainerSync._balance_batch(trainer, kv_batch(data["tokens"], data["prompt"], data["uid"]), {})
    order = [tag["row"] for tag in ours.tags]
    assert sorted(order) == list(range(len(order))) and all(keys_before[k] == r for k, r in zip(ours.keys, order))
    cost, verl_cost = busiest(order, data, False, False), busiest([t["row"] for t in theirs.tags], data, False, False)
    assert cost <= verl_cost * (1 + 1e-9), (cost, verl_cost)
    untagged = kv_batch(data["tokens"], data["prompt"], data["uid"])
    for tag in untagged.tags:
        del tag["prompt_len"]
    try:
        trainer._balance_batch(untagged, metrics={})
        refusal = "a batch without prompt_len tags was balanced"
    except ValueError as error:
        refusal = str(error)
    assert "prompt_len" in refusal and "agent loop" in refusal, refusal
    report("balanced_v1", trainer=type(trainer).__name__, packfeed_busiest=cost, verl_busiest=verl_cost,
           packfeed_dist=metrics["global_seqlen/packfeed_dist"], untagged_refused=refusal)


def balanced_legacy(config, data: dict, grouper: bool) -> None:
    trainer = object.__new__(verl_ppo.PackfeedPPOTrainer)
    trainer.config, trainer.use_prefix_grouper, trainer.actor_rollout_wg = config, grouper, ActorWorkers(DP)
    batch, metrics = data_proto(data["tokens"], data["prompt"], data["uid"], data["grids"]), {}
    before = batch.batch["attention_mask"].clone()
    trainer._balance_batch(batch, metrics=metrics)
    order = batch.batch["index"].tolist()
    assert sorted(order) == list(range(len(order))) and bool((batch.batch["attention_mask"] == before[order]).all())
    if grouper:  # a group's rollouts all in one rank's chunk
        chunks = np.array_split(np.asarray(batch.non_tensor_batch["uid"]), DP)
        assert sum(len(set(c)) for c in chunks) == PROMPTS, chunks
    theirs = data_proto(data["tokens"], data["prompt"], data["uid"], data["grids"])
    RayPPOTrainer._balance_batch(trainer, theirs, {})
    cost = busiest(order, data, True, grouper)
    verl_cost = busiest(theirs.batch["index"].tolist(), data, True, grouper)
    assert cost <= verl_cost * (1 + 1e-9), (cost, verl_cost)
    report("balanced_legacy", prefix_grouper=grouper, packfeed_busiest=cost, verl_busiest=verl_cost,
           groups_whole=metrics["global_seqlen/packfeed_groups_whole"])


def main() -> None:
    installed()
    composed()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose("ppo_trainer", overrides=verl_ppo.overrides(OVERRIDES))
        plain_config = compose("ppo_trainer", overrides=OVERRIDES)
    in_rays_process(config.copy(), plain_config)
    verl_ppo.install()
    for seed in range(3):
        data = step(seed)
        balanced_v1(config, data)
        balanced_legacy(config, data, grouper=False)
        balanced_legacy(config, data, grouper=True)


if __name__ == "__main__":
    main()
