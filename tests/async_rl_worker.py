"""The processes of an asynchronous GRPO run on CPU, for tests/test_async_rl.py: trainers that train a tiny causal LM
on a live job's packs and publish each version's weights to a folder, and producers that generate with the newest
weights they find there (HF `generate`; the folder is a `WeightVersions`), each group reserved before it is
generated (staleness wait).

    python -m torch.distributed.run --nproc-per-node 2 async_rl_worker.py trainer TARGET JOB WEIGHTS OUT
    python async_rl_worker.py producer TARGET JOB WEIGHTS OUT NAME GROUPS [kill]

Tokens: the model's ids 0..VOCAB-1 are the job's ids OFFSET.. (in the dataset's vocabulary, clear of its image
markers). A trainer writes OUT/trainer-r{rank}.json: per step the version it trained and each sample's key, group,
policy version and its trained tokens' versions. A producer writes OUT/producer-{name}.json: each group it put with
its rewards and versions. With `kill`, the producer puts three rollouts of group "long" whole and a fourth
unfinished (its first half), then kills itself (SIGKILL); `claim` producers continue what they find unfinished.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from packfeed.client import PackStream, PlanConfig, Producer, ProducersGone
from packfeed.client.model.losses import decoupled_policy_loss, token_logprobs
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.stream.channel import PackfeedError
from packfeed.v1 import packfeed_pb2 as pb

VOCAB, OFFSET, PROMPT, NEW = 64, 300, 6, 10
PLAN = PlanConfig(dp=2, microbatches=1, live=True, step_samples=8, staleness="wait", max_staleness=1,
                  producer_timeout_s=600, group_size=4, filter_groups="reward", token_cap=512,
                  vision_cap=64)


def model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def publish(weights: Path, net: torch.nn.Module, version: int) -> None:
    """Version `version`'s weights, named the newest once whole (`WeightVersions`)."""
    WeightVersions(weights, keep=1000).publish(net.state_dict(), version)


# -- the trainers --------------------------------------------------------------------------------------------


def train(target: str, job: str, weights: Path, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = model()
    net.load_state_dict(WeightVersions(weights).load(0)[1])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    stream = PackStream(target, job=job, rank=rank, plan=PLAN)
    version, record = 0, []
    try:
        for step in stream:
            trained, loss = [], torch.zeros(())
            for pack in step.packs:
                cu = pack.cu_seqlens.tolist()
                for k, key in enumerate(pack.sample_keys):
                    span = slice(cu[k], cu[k + 1])
                    ids, labels = pack.input_ids[span].long() - OFFSET, pack.labels[span].long()
                    labels = torch.where(labels >= 0, labels - OFFSET, labels)
                    logp, mask = token_logprobs(net(ids[None]).logits[0], labels)
                    tensors = {name: values[span] for name, values in pack.token_tensors.items()}
                    loss = loss + decoupled_policy_loss(logp, logp.detach(), tensors["logprobs"],
                                                        tensors["advantages"], mask,
                                                        normalizer=max(1, pack.step_loss_tokens) / 2)
                    versions = pack.token_policy_version[span][pack.labels[span] >= 0]
                    trained.append([key, pack.sample_groups[k], int(pack.policy_version[k]), versions.tolist()])
            optimizer.zero_grad()
            if loss.requires_grad:  # (a rank's packs of the job's last step may hold no sample)
                loss.backward()
            for parameter in net.parameters():  # data parallel: the ranks' gradients summed, as DDP does
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad)
            optimizer.step()
            record.append({"step": step.step, "trained_by": version, "samples": trained})
            version += 1
            if rank == 0:
                publish(weights, net, version)
            dist.barrier()  # the new weights are out before either rank says it holds them
            stream.policy_version = version
        outcome = "ended"
    except ProducersGone as gone:
        outcome = f"gone: {gone}"
    (out / f"trainer-r{rank}.json").write_text(json.dumps({"steps": record, "outcome": outcome}))
    stream.close()


# -- the producers -------------------------------------------------------------------------------------------


class Policy:
    """The newest weights the trainers published, loaded when a newer version appears."""

    def __init__(self, weights: Path):
        self.versions, self.net, self.version = WeightVersions(weights, keep=1000), model(), -1
        self.refresh()

    def refresh(self) -> int:
        return self.load(self.versions.newest())

    def load(self, version: int) -> int:
        """Version `version`'s weights (published before the trainers report holding it)."""
        if version != self.version:
            self.net.load_state_dict(self.versions.wait_for(version, timeout_s=600))
            self.version = version
        return version

    def generate(self, tokens: np.ndarray, new: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """`new` tokens sampled after `tokens` (the job's ids) and their log-probabilities under this policy."""
        torch.manual_seed(seed)
        with torch.no_grad():
            output = self.net.generate(torch.as_tensor(tokens - OFFSET)[None], do_sample=True, top_k=0, top_p=1.0,
                                       max_new_tokens=new, min_new_tokens=new, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=0)
        generated = output.sequences[0, len(tokens):]
        logp = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(output.logits, generated)])
        return generated.numpy() + OFFSET, logp.numpy()


def reward(completion: np.ndarray) -> float:
    """1 when the completion's ids sum to an even number: a coarse score, so some groups score all alike."""
    return float(int(completion.sum()) % 2 == 0)


def sample(sample_id: str, group: str, prompt: np.ndarray, completion: np.ndarray, logp: np.ndarray, version: int,
           score: float) -> dict:
    tokens = np.concatenate([prompt, completion])
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.uint8)
    behaviour = np.r_[np.zeros(len(prompt)), logp].astype(np.float32)
    advantages = (mask * (score - 0.5)).astype(np.float32)
    return {"id": sample_id, "tokens": tokens, "loss_mask": mask, "group": group, "policy_version": version,
            "tensors": {"logprobs": behaviour, "advantages": advantages}, "values": {"reward": score}}


def produce(target: str, job: str, weights: Path, out: Path, name: str, groups: int, kill: bool) -> None:
    policy, log = Policy(weights), {"groups": [], "continued": []}
    producer = Producer(target, job=job, name=name, heartbeat_s=1.0, open_wait_s=600, full_wait_s=600)
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same prompts every run

    def save() -> None:
        (out / f"producer-{name}.json").write_text(json.dumps(log))

    if kill:
        kill_mid_rollout(producer, policy, rng, log, save)
    for number in range(groups):
        continue_unfinished(producer, policy, log)
        group = f"{name}-g{number}"
        # the grant names the version to generate with (the job's): no sample is generated too early to train
        version = policy.load(producer.reserve(group=group).policy_version)
        prompt = rng.integers(OFFSET, OFFSET + VOCAB, PROMPT)
        put = []
        for member in range(PLAN.group_size):
            completion, logp = policy.generate(prompt, NEW, seed=number * 10 + member)
            put.append(sample(f"{group}-{member}", group, prompt, completion, logp, version, reward(completion)))
        producer.put(put)
        log["groups"].append({"group": group, "ids": [s["id"] for s in put], "version": version,
                              "rewards": [s["values"]["reward"] for s in put]})
        save()
    deadline = time.monotonic() + 600  # until no rollout is left unfinished (a claim may wait for a grant)
    while time.monotonic() < deadline:
        if not continue_unfinished(producer, policy, log):
            if not unfinished_left(producer, job):
                break
            time.sleep(0.2)  # the rollout held waits for newer weights (or another producer holds it)
    save()
    producer.close()


def kill_mid_rollout(producer: Producer, policy: Policy, rng, log: dict, save) -> None:
    """Group "long": three rollouts whole, the fourth put unfinished halfway (its tokens' versions this policy's);
    then this process dies as a kill -9 would have it, mid-rollout."""
    version = policy.load(producer.reserve(group="long").policy_version)
    prompt = rng.integers(OFFSET, OFFSET + VOCAB, PROMPT)
    whole = []
    for member, score in zip(range(3), (0.0, 1.0, 0.5)):  # rewards that differ: the group is trained
        completion, logp = policy.generate(prompt, NEW, seed=100 + member)
        whole.append(sample(f"long-{member}", "long", prompt, completion, logp, version, score))
    producer.put(whole)
    completion, logp = policy.generate(prompt, NEW // 2, seed=103)
    unfinished = sample("long-3", "long", prompt, completion, logp, version, 0.0)
    unfinished.update(unfinished=True, token_versions=np.full(PROMPT + NEW // 2, version, np.int64))
    del unfinished["values"]  # scored once finished
    producer.put(unfinished)
    log["groups"].append({"group": "long", "ids": [s["id"] for s in whole] + ["long-3"], "version": version,
                          "rewards": [0.0, 1.0, 0.5, None]})
    save()
    os.kill(os.getpid(), signal.SIGKILL)


def unfinished_left(producer: Producer, job: str) -> bool:
    """Whether the job still holds a rollout put unfinished (GetJob's count)."""
    return producer.channel.call("GetJob", pb.GetJobRequest(job=job)).live.partials > 0


def continue_unfinished(producer: Producer, policy: Policy, log: dict) -> bool:
    """Claim an unfinished rollout (waiting a few seconds for one: its producer's claim lapses, a grant opens)
    and, once the trainers published weights newer than its newest tokens, finish it with them; whether one was
    finished."""
    version = policy.refresh()
    rollout = producer.claim(policy_version=version, wait_s=2.0)  # (again: the rollout this producer holds)
    if rollout is None or version <= rollout.policy_version:
        # No newer weights yet: keep the claim and generate groups meanwhile. Waiting here could wait forever:
        # the newer weights may need this producer's own groups to fill the step they train on.
        return False
    completion, logp = policy.generate(rollout.tokens, NEW - (len(rollout.tokens) - PROMPT), seed=7)
    finished = rollout.continued(completion, version, tensors={"logprobs": logp, "advantages": np.zeros(len(logp))},
                                 values={"reward": reward(completion)})
    producer.put(finished)
    log["continued"].append({"id": rollout.id, "from_version": rollout.policy_version, "with_version": version})
    return True


def main() -> None:
    role, target, job, weights, out = sys.argv[1:6]
    weights, out = Path(weights), Path(out)
    if role == "trainer":
        train(target, job, weights, out)
    else:
        try:
            produce(target, job, weights, out, sys.argv[6], int(sys.argv[7]), sys.argv[8:] == ["kill"])
        except PackfeedError as error:  # the job ended while this producer waited for a grant
            (out / f"producer-{sys.argv[6]}.error").write_text(str(error))


if __name__ == "__main__":
    main()
