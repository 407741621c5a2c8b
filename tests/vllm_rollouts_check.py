"""Run inside vLLM's own environment (tests/vllm_env.py; tests/test_vllm_rollouts.py runs it): real vLLM on the CPU
fed by a Packfeed prompt job, a tiny Qwen2-VL built from a config, images in the prompts. Each check prints one
JSON line; the test asserts on them. Checks 1-3 run on two engines, their lines named `offline/...` (vLLM's `LLM`
in this process, `VLLMEngine`: images as embeddings of the loader server's pixel values) and `server/...` (a
`vllm serve` process on loopback, tests/vllm_serve.py, through `VLLMServerEngine`: the pixel values themselves over
HTTP); each engine is first given the model's weights through the worker's path (version 0).

1. greedy: the engine's greedy completion of each prompt and transformers' greedy completion of the same prompt on
   the same pixel values;
2. logprobs: a `RolloutWorker` generates (temperature 1) and puts into a live job; a trainer-side stream reads the
   live job's packs, and the trainer's model (transformers, `to_hf_inputs`) gives its log-probabilities of the
   trained tokens, beside the behaviour log-probabilities the worker put;
3. weights: the trainer's weights change and are published as version 1 (`WeightVersions`); the worker's next
   step loads them; greedy completions before and after, the engine's and transformers';
4. trl: `PackfeedGRPOTrainer(use_vllm=True, vllm_mode="colocate")` at DP 2 under torchrun
   (tests/vllm_grpo_worker.py), each rank's rollouts from its colocated vLLM: what each rank recorded;
5. async: an asynchronous GRPO run ([3/6]: staleness wait, max_staleness 1, whole groups of 4) whose producers are
   two rollout workers (tests/vllm_producer.py), one with vLLM in its process, one on the vLLM server, each group
   reserved and generated with the version its grant names; this process trains on the live job's packs (the
   decoupled policy loss on the behaviour log-probabilities the workers put) and publishes each version: what each
   step trained, and what each producer loaded.

    python tests/vllm_rollouts_check.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawned core
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

FAMILY, NEW = "qwen2_vl", 8
# head dim 64: vLLM's CPU attention takes no smaller one
TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}


def say(check: str, **fields) -> None:
    print(json.dumps({"check": check, **fields}), flush=True)


def model_folder(data, folder: Path):
    """The tiny model, saved as vLLM loads one: weights, config, tokenizer and the Qwen2-VL processor's settings
    (the index's pixel bounds)."""
    from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    from packfeed.trainer.models.hf.build import build_hf_model

    model = build_hf_model(FAMILY, data.conventions, {"text": TEXT}).eval()
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(data.tokenizer), eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    policy = json.loads(data.conventions.image_policy.parameters_json)
    images = Qwen2VLImageProcessor(min_pixels=policy["min_pixels"], max_pixels=policy["max_pixels"])
    Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor()).save_pretrained(folder)
    return model


def hf_greedy(model, prompt) -> list[int]:
    ids = torch.tensor([prompt.ids])
    extra = {}
    if prompt.fields:
        extra = {**prompt.fields, "mm_token_type_ids": torch.tensor([prompt.token_types])}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, **extra)
    return out[0, len(prompt.ids):].tolist()


def greedy_pairs(engine, model, prompts, conventions) -> list[dict]:
    from packfeed.client.rollouts.engine_io import Sampling, engine_request

    requests = [engine_request(p, conventions) for p in prompts]
    completions = engine.generate(requests, 1, Sampling(max_tokens=NEW, temperature=0.0))
    return [{"key": p.key, "images": len(p.fields.get("image_grid_thw", [])), "vllm": c[0].token_ids.tolist(),
             "transformers": hf_greedy(model, p)} for p, c in zip(prompts, completions)]


def trainer_logprobs(model, pack, conventions) -> tuple[list[float], list[float], list[int]]:
    """The trainer's log-probabilities of a live pack's trained tokens, the behaviour ones the pack carries, and
    each token's policy version."""
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.client.model.losses import shifted, token_logprobs

    inputs = to_hf_inputs(pack, FAMILY, conventions=conventions)
    inputs.pop("num_items_in_batch", None)
    labels = inputs.pop("labels")[0]
    with torch.no_grad():
        logp, mask = token_logprobs(model(**inputs).logits[0].float(), labels)
    behaviour = shifted(pack.token_tensors["logprobs"].float())  # aligned with the shifted labels
    kept = mask.bool()
    versions = shifted(pack.tensors["token_policy_version"].float())[kept].long()
    return logp[kept].tolist(), behaviour[kept].tolist(), versions.tolist()


def main() -> None:
    from hf_models import family_dataset
    from vllm_serve import VLLMServer

    from packfeed.client import LocalServer
    from packfeed.client.rollouts.prompts import prompt_job_stream, prompts_of
    from packfeed.client.rollouts.vllm_engine import VLLMEngine
    from packfeed.client.rollouts.vllm_server import VLLMServerEngine

    out = Path(sys.argv[1])
    data = family_dataset(out / "data", FAMILY, samples=8)  # two prompt steps an epoch at DP 2 x 2 prompts
    model = model_folder(data, out / "model")
    served = VLLMServer(out / "model", out / "vllm-serve.log")  # starts while this process loads its own engine
    try:
        import vllm

        say("installed", vllm=vllm.__version__, transformers=__import__("transformers").__version__)
        engine = VLLMEngine.from_pretrained(str(out / "model"), dtype="float32", max_model_len=512,
                                            enforce_eager=True, limit_mm_per_prompt={"image": 4}, seed=0)
        with LocalServer(data.index, workers=1, extra_args=["--live-spool", str(out / "spool")]) as server:
            stream = prompt_job_stream(server.target, "greedy", consumers=1, consumer=0, per_consumer=8)
            conventions = stream.conventions
            prompts = [p for step in stream for pack in step.packs for p in prompts_of(pack, FAMILY, conventions)]
            stream.close()
            engine_checks("offline", engine, model, prompts, conventions, server.target, out)
            del engine  # its memory, before the trainers start two more
            remote = VLLMServerEngine(served.wait(), tokenizer=data.tokenizer)
            engine_checks("server", remote, model, prompts, conventions, server.target, out)
            remote.close()
            say("trl", ranks=trl_colocated(server.target, data, out))
            say("async", **asynchronous(server.target, model, out, served.url))
    finally:
        served.stop()


def engine_checks(name: str, engine, model, prompts, conventions, target: str, out: Path) -> None:
    """Checks 1-3 (greedy, logprobs, weights) on one engine, each line's check named NAME/CHECK. The engine is
    first given the model's weights as they are now (version 0), through the worker's own path."""
    from packfeed.client import PackStream, PlanConfig, Producer
    from packfeed.client.rollouts.engine_io import Sampling
    from packfeed.client.rollouts.prompts import prompt_job_stream
    from packfeed.client.rollouts.weights import WeightVersions
    from packfeed.client.rollouts.worker import RolloutWorker

    weights = WeightVersions(out / f"{name}-weights")
    weights.publish(model.state_dict(), 0)
    engine.load_version(weights, 0, 60)
    say(f"{name}/greedy", pairs=greedy_pairs(engine, model, prompts, conventions))

    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=12, token_cap=2048, vision_cap=256)
    producer = Producer(target, job=f"{name}-rollouts", plan=plan, name=f"{name}-0")
    worker = RolloutWorker(engine, prompt_job_stream(target, f"{name}-rl", consumers=1, consumer=0, per_consumer=3),
                           producer, [lambda completions, **_: [len(c) / 10 for c in completions]],
                           family=FAMILY, weights=weights, generations=4,
                           sampling=Sampling(max_tokens=NEW, temperature=1.0, seed=3))
    worker.run(steps=1)
    trainer = PackStream(target, job=f"{name}-rollouts", rank=0, plan=plan)
    step = next(iter(trainer))
    ours, theirs = [], []
    for pack in step.packs:
        mine, put, _ = trainer_logprobs(model, pack, trainer.conventions)
        ours += mine
        theirs += put
    say(f"{name}/logprobs", trainer=ours, behaviour=theirs, versions=sorted(set(pack.policy_version.tolist())),
        samples=len(step.sample_keys))

    before = greedy_pairs(engine, model, prompts, conventions)
    torch.manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    weights.publish(model.state_dict(), 1)
    worker.run(steps=1)  # its next prompt step loads version 1, the newest
    after = greedy_pairs(engine, model, prompts, conventions)
    say(f"{name}/weights", before=before, after=after, loaded=worker.report.versions)
    trainer.close()
    worker.close()
    say(f"{name}/partial", **partial_rollouts(name, engine, model, weights, target))


class PublishingAfterFirst:
    """The engine, and the trainer publishing version 2 (the model's weights changed again) once the engine's
    first generate call returned: a weight update in the middle of the worker's generation, at a known point."""

    def __init__(self, engine, publish):
        self.engine, self.publish, self.calls = engine, publish, 0

    def generate(self, requests, n, sampling):
        out = self.engine.generate(requests, n, sampling)
        self.calls += 1
        if self.calls == 1:
            self.publish()
        return out

    def __getattr__(self, name):  # load_version, decode: the engine's own
        return getattr(self.engine, name)


def partial_rollouts(name: str, engine, model, weights, target: str) -> dict:
    """A worker generating 3 tokens at a time (partial_tokens) while version 2 is published after its first chunk:
    the completions still running go on with version 2. The trainer's log-probability of each trained token under
    the version that generated it (the model's weights at version 1 or 2, the pack's token_policy_version), beside
    the behaviour log-probabilities put."""
    from packfeed.client import PackStream, PlanConfig, Producer
    from packfeed.client.rollouts.engine_io import Sampling
    from packfeed.client.rollouts.prompts import prompt_job_stream
    from packfeed.client.rollouts.worker import RolloutWorker

    states = {1: {k: v.clone() for k, v in model.state_dict().items()}}  # what the engine holds (version 1)

    def publish() -> None:
        torch.manual_seed(6)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        states[2] = {k: v.clone() for k, v in model.state_dict().items()}
        weights.publish(model.state_dict(), 2)

    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=4, token_cap=2048, vision_cap=256)
    producer = Producer(target, job=f"{name}-partial-rollouts", plan=plan, name=f"{name}-partial")
    worker = RolloutWorker(PublishingAfterFirst(engine, publish),
                           prompt_job_stream(target, f"{name}-partial", consumers=1, consumer=0, per_consumer=2),
                           producer, [lambda completions, **_: [len(c) / 10 for c in completions]],
                           family=FAMILY, weights=weights, generations=2, policy_version=1, partial_tokens=3,
                           sampling=Sampling(max_tokens=NEW, temperature=1.0, seed=4))
    worker.run(steps=1)
    trainer = PackStream(target, job=f"{name}-partial-rollouts", rank=0, plan=plan)
    step = next(iter(trainer))
    ours, theirs, versions = [], [], []
    for pack in step.packs:
        by_version = {}
        for version, state in states.items():
            model.load_state_dict(state)
            by_version[version], put, token_versions = trainer_logprobs(model, pack, trainer.conventions)
        ours += [by_version[v][i] for i, v in enumerate(token_versions)]
        theirs += put
        versions += token_versions
    trainer.close()
    worker.close()
    return {"trainer": ours, "behaviour": theirs, "versions": versions, "continued": worker.report.continued,
            "loaded": worker.report.versions, "policy_versions": sorted(set(pack.policy_version.tolist()))}


ASYNC = {"steps": 3, "group": 4}


def asynchronous(target: str, model, out: Path, server_url: str) -> dict:
    """Two vLLM producers (3 prompt steps of 1 prompt each, G = 4), the first with vLLM in its process, the second
    generating on the vLLM server at `server_url`, and this process training 3 live steps of 8."""
    import subprocess
    import threading

    from packfeed.client import PackStream, PlanConfig, Producer
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.client.model.losses import decoupled_policy_loss, token_logprobs
    from packfeed.client.rollouts.weights import WeightVersions

    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=8, staleness="wait", max_staleness=1,
                      producer_timeout_s=600, group_size=ASYNC["group"], token_cap=4096, vision_cap=512)
    weights = WeightVersions(out / "async-weights", keep=100)
    weights.publish(model.state_dict(), 0)
    opener = Producer(target, job="async-rollouts", plan=plan, heartbeat_s=0)  # opens the job before anyone
    record, optimizer = [], torch.optim.SGD(model.parameters(), lr=0.05)
    stream = PackStream(target, job="async-rollouts", rank=0, plan=plan)

    def train() -> None:
        try:
            train_steps()
        except BaseException as error:  # said by the main thread
            failed.append(error)

    def train_steps() -> None:
        version = 0
        for step in stream:
            loss, seen = torch.zeros(()), []
            for pack in step.packs:
                if pack.empty:  # the job's end: a last step with nothing left
                    continue
                inputs = to_hf_inputs(pack, FAMILY, conventions=stream.conventions)
                inputs.pop("num_items_in_batch", None)
                labels = inputs.pop("labels")[0]
                logp, mask = token_logprobs(model(**inputs).logits[0], labels)
                tensors = pack.token_tensors
                loss = loss + decoupled_policy_loss(logp, logp.detach(), tensors["logprobs"][:len(logp)],
                                                    tensors["advantages"][:len(logp)], mask,
                                                    normalizer=max(1, pack.step_loss_tokens))
                seen += [[key, int(v)] for key, v in zip(pack.sample_keys, pack.policy_version.tolist())]
            if not seen:
                continue
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record.append({"trained_by": version, "samples": seen})
            version += 1
            weights.publish(model.state_dict(), version)  # published before the job hears of it
            stream.policy_version = version

    failed: list[BaseException] = []
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    producer = Path(__file__).with_name("vllm_producer.py")
    producers = [subprocess.Popen([sys.executable, str(producer), target, str(out / "model"),
                                   str(out / "async-weights"), str(out), str(index), str(ASYNC["steps"]),
                                   *([server_url] if index == 1 else [])],
                                  stdout=subprocess.DEVNULL, stderr=open(out / f"producer-{index}.log", "w"))
                 for index in range(2)]
    for index, process in enumerate(producers):
        if process.wait(600) != 0:
            raise RuntimeError((out / f"producer-{index}.log").read_text()[-6000:])
    opener.end()  # what is pending forms the last step
    trainer.join(600)
    stream.close()
    if failed or trainer.is_alive():
        raise RuntimeError(f"the trainer failed or hung: {failed}")
    return {"steps": record, "producers": [json.loads((out / f"producer-{i}.json").read_text()) for i in range(2)]}


def trl_colocated(target: str, data, out: Path) -> list[dict]:
    import subprocess

    from ports import free_port

    runs = out / "trl"
    runs.mkdir()
    worker = Path(__file__).with_name("vllm_grpo_worker.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(worker), target, "trl", str(out / "model"),
                           str(data.tokenizer), str(runs)], capture_output=True, text=True, timeout=480)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-8000:])
    return [json.loads((runs / f"rank{rank}.json").read_text()) for rank in range(2)]


if __name__ == "__main__":
    main()
