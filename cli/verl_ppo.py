"""verl's `main_ppo` with Packfeed's balance: run in verl's environment, in place of `python -m
verl.trainer.main_ppo`, with the same Hydra overrides:

    python -m packfeed.cli.verl_ppo data.train_files=... actor_rollout_ref.model.path=... trainer.n_gpus_per_node=8

Everything is verl's own (its config, its Ray cluster, its workers, its trainer loop) except where a step's batch
is balanced over the data-parallel ranks: there Packfeed's planner orders it (packfeed.cli.verl_batches).

How it gets there: verl builds its trainer inside a Ray actor (its TaskRunner), in a process of Ray's. This entry
adds one override, a Ray worker setup hook (`ray_kwargs.ray_init.runtime_env.worker_process_setup_hook`), so that
every process of the job runs `install()` before verl's code builds a trainer. `install()` puts Packfeed's
subclasses in the place of verl's trainers: each v1 trainer in verl's registry (`trainer.v1.trainer_mode` sync,
colocate_async, separate_async; verl's default) and the legacy `RayPPOTrainer` (`trainer.use_v1=false`). A trainer
a recipe registers later is not replaced.

This module imports verl: nothing in Packfeed imports it; verl's environment runs it (docs/training.md).
"""

from __future__ import annotations

import sys

from verl.trainer import main_ppo, main_ppo_v0
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync, trainer_base

from packfeed.cli.verl_batches import balance_batch, balance_kv_batch

SETUP_HOOK = "ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
MODULE = "packfeed.cli.verl_ppo"  # this module's name also when run as __main__: what Ray's workers import


class PackfeedPPOTrainer(RayPPOTrainer):
    """verl's legacy trainer; its steps balanced by Packfeed on their images and tokens, each group on one rank
    with its prompt counted once where the actor computes it once (`actor.use_prefix_grouper`)."""

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        minibatch = self.config.actor_rollout_ref.actor.ppo_mini_batch_size if keep_minibatch else None
        balance_batch(batch, self._get_dp_size(self.actor_rollout_wg, "actor"), metrics=metrics,
                      shared_prefix=self.use_prefix_grouper, logging_prefix=logging_prefix,
                      minibatch_size=minibatch)


class PackfeedBalanceV1:
    """What a v1 trainer of verl's balances its steps with: verl's padding to whole mini-batches, then Packfeed's
    order on the rollouts' tags."""

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        dp_size = actor_dp_size(self.actor_rollout_wg)
        batch = upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                 self.tokenizer.eos_token_id)
        return balance_kv_batch(batch, dp_size, metrics=metrics, logging_prefix=logging_prefix)


def actor_dp_size(worker_group) -> int:
    """The actor's data-parallel size, from its worker group's dispatch (cached there), as verl's trainers read it."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


class PackfeedPPOTrainerSync(PackfeedBalanceV1, PPOTrainerSync):
    """verl's synchronous v1 trainer (`trainer.v1.trainer_mode=sync`, verl's default), balanced by Packfeed."""


class PackfeedPPOTrainerColocateAsync(PackfeedBalanceV1, PPOTrainerColocateAsync):
    """verl's colocated asynchronous v1 trainer, balanced by Packfeed."""


class PackfeedPPOTrainerSeparateAsync(PackfeedBalanceV1, PPOTrainerSeparateAsync):
    """verl's separated asynchronous v1 trainer, balanced by Packfeed."""


V1_TRAINERS = {"sync": PackfeedPPOTrainerSync, "colocate_async": PackfeedPPOTrainerColocateAsync,
               "separate_async": PackfeedPPOTrainerSeparateAsync}


def install() -> None:
    """In this process, verl's trainers are Packfeed's subclasses of them (idempotent; Ray's setup hook)."""
    trainer_base.TRAINER_REGISTRY.update(V1_TRAINERS)
    main_ppo_v0.RayPPOTrainer = PackfeedPPOTrainer


def overrides(argv: list[str]) -> list[str]:
    """verl's overrides as given, with the setup hook that installs Packfeed's trainers in every Ray process."""
    if any(arg.lstrip("+~").startswith(SETUP_HOOK) for arg in argv):
        raise SystemExit(f"{MODULE} sets {SETUP_HOOK} itself: call your own hook from a module of yours that "
                         f"also calls {MODULE}.install(), and run verl's main_ppo with it instead")
    return [*argv, f"+{SETUP_HOOK}={MODULE}.install"]


def main() -> None:
    install()  # the driver too (Ray's local mode and a TaskRunner started in this process)
    sys.argv[1:] = overrides(sys.argv[1:])
    main_ppo.main()


if __name__ == "__main__":
    from packfeed.cli import verl_ppo  # as Ray's workers import it: one set of Packfeed's trainer classes

    verl_ppo.main()
