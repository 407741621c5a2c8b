"""Run inside verl's own environment (tests/verl_env.py): each step of STEPS.npz
as a verl `DataProto` (its attention masks, prompts, uids and Qwen-style image grids), balanced by verl's own
`RayPPOTrainer._balance_batch` (plain, and with `use_prefix_grouper`) and by Packfeed's
`packfeed.cli.verl_batches.balance_batch`, each as its trainer calls it. Writes OUT.json: per step and method, the
order the balanced batch holds the rollouts in (the dispatch then hands rank r its r-th equal chunk), and checks
Packfeed's result as a DataProto: every rollout once, every tensor and non-tensor field reordered together.

    python verl_balance.py STEPS.npz DP OUT.json
"""

from __future__ import annotations

import json
import sys
import time
import types
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the batches as verl holds them
from verl_batches import data_proto  # noqa: E402

from packfeed.cli.verl_batches import balance_batch  # noqa: E402


def verl_order(batch: DataProto, dp: int, prefix_grouper: bool) -> tuple[list[int], float]:
    trainer = types.SimpleNamespace(_get_dp_size=lambda group, role: dp, actor_rollout_wg=None,
                                    use_prefix_grouper=prefix_grouper, config=None)
    start = time.perf_counter()
    RayPPOTrainer._balance_batch(trainer, batch, {})
    return batch.batch["index"].tolist(), time.perf_counter() - start


def main() -> None:
    steps_path, dp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    steps = np.load(steps_path, allow_pickle=True)
    results = []
    for k in range(int(steps["count"])):
        tokens, prompt, uid = steps[f"tokens{k}"], steps[f"prompt{k}"], steps[f"uid{k}"]
        grids = list(steps[f"grids{k}"])
        result = {}
        for name, grouper in (("verl", False), ("verl_prefix_grouper", True)):
            result[name], result[f"{name}_s"] = verl_order(data_proto(tokens, prompt, uid, grids), dp, grouper)
        for name, shared in (("packfeed", False), ("packfeed_groups", True)):
            batch = data_proto(tokens, prompt, uid, grids)
            before = {"mask": batch.batch["attention_mask"].clone(), "uid": batch.non_tensor_batch["uid"].copy()}
            start = time.perf_counter()
            same = balance_batch(batch, dp, shared_prefix=shared)
            result[f"{name}_s"] = time.perf_counter() - start
            order = batch.batch["index"].tolist()
            assert same is batch and sorted(order) == list(range(len(tokens)))  # in place, every rollout once
            assert torch.equal(batch.batch["attention_mask"], before["mask"][order])  # rows moved whole
            assert list(batch.non_tensor_batch["uid"]) == list(before["uid"][order])
            if shared:  # each group in one rank's chunk
                chunks = np.asarray(batch.non_tensor_batch["uid"]).reshape(dp, -1)
                assert len({u for row in chunks for u in set(row)}) == sum(len(set(row)) for row in chunks)
            result[name] = order
        results.append(result)
    with open(out, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
