"""TRL's GRPO through Packfeed (`packfeed.client.frameworks.trl.PackfeedGRPOTrainer`), DP 2 under torchrun on CPU, against a
real server with a live spool, a tiny Qwen2-VL built from a config, images in the prompts and a reward over the
generated text (tests/grpo_worker.py).

- The same optimisation as TRL's own step: the rollouts one run generated and scored are recorded, and TRL's own
  `GRPOTrainer` trains on them in the same order; 4 steps give the same losses and the same weights (clipping
  with DAPO's upper epsilon, the KL term against the reference model, TRL's default DAPO normalisation).
- A run killed after a checkpoint and resumed trains the same rollouts with bit-identical losses and weights.
- Under ZeRO-3 and FSDP with the vision tower wrapped apart, a step where one rank's prompts hold no image while
  the other's do completes.
- What the face cannot honour is refused, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forked_torchrun import torchrun as forked_torchrun

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "grpo_worker.py"


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    from hf_models import family_dataset, tiny_model

    data = family_dataset(tmp_path_factory.mktemp("grpo"), "qwen2_vl", samples=16)
    tiny_model("qwen2_vl", data).save_pretrained(data.index.parent / "model")  # TRL loads its reference from a path
    return data


@pytest.fixture(scope="module")
def server(grpo_data, tmp_path_factory):
    from packfeed.client import LocalServer

    spool = tmp_path_factory.mktemp("spool")
    with LocalServer(grpo_data.index, workers=1, extra_args=["--live-spool", str(spool)]) as running:
        yield running


def torchrun(server, data, mode: str, job: str, out: Path, **env: str) -> list[dict]:
    """`torchrun --nproc-per-node 2 grpo_worker.py MODE ...`, its ranks forked preloaded (`forked_torchrun`)."""
    forked_torchrun(WORKER, [mode, server.target, job, data.index.parent / "model", data.tokenizer, out],
                    out / "logs", env=env)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)] if mode != "kill" else []


def params(out: Path):
    import torch

    return torch.load(out / "params.pt")


def recorded(out: Path, step: int, rank: int) -> dict:
    import torch

    return torch.load(out / f"batch-s{step}-r{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def straight(server, grpo_data, tmp_path_factory):
    """A run through Packfeed, TRL generating: its losses, weights and recorded rollouts."""
    out = tmp_path_factory.mktemp("straight")
    return out, torchrun(server, grpo_data, "packfeed", "straight", out)


def test_packfeed_trains_trls_own_grpo_step_on_the_same_rollouts(server, grpo_data, straight, tmp_path):
    from safetensors.torch import load_file

    out, runs = straight
    own = torchrun(server, grpo_data, "trl", "unused", tmp_path, PACKFEED_TEST_RECORDED=str(out))
    ours, theirs = runs[0]["losses"], own[0]["losses"]
    assert sorted(ours) == sorted(theirs) == ["1", "2", "3", "4"]
    assert [ours[k] for k in sorted(ours)] == pytest.approx([theirs[k] for k in sorted(ours)], abs=1e-5, rel=1e-4)
    trained, reference = params(out), params(tmp_path)
    initial = load_file(grpo_data.index.parent / "model" / "model.safetensors")
    worst = max((trained[k] - reference[k]).abs().max().item() for k in trained)
    assert worst < 1e-6, f"weights differ from TRL's own steps by up to {worst}"
    moved = max((trained[k] - v).abs().max().item() for k, v in initial.items() if k in trained)
    assert moved > 1e-3  # the steps did train: equal weights are not the initial ones
    # each step trained every rollout of both ranks once, in group-aware packs: a prompt computed once for its G
    for step in range(4):
        packs = [json.loads((out / f"packs-s{step}-r{r}.json").read_text()) for r in range(2)]
        keys = [key for rank in packs for pack in rank for key in pack["keys"]]
        assert sorted(keys) == sorted(f"s{step}-r{r}-{i}" for r in range(2) for i in range(4))
    shared = [pack["shared"] for s in range(4) for r in range(2)
              for pack in json.loads((out / f"packs-s{s}-r{r}.json").read_text())]
    assert any(shared), "no pack shared a prompt between its responses"


def test_a_killed_grpo_run_resumes_with_the_same_rollouts_and_bit_identical_losses(server, grpo_data, straight,
                                                                                      tmp_path):
    import torch

    out, runs = straight
    torchrun(server, grpo_data, "kill", "killed", tmp_path)  # dies right after step 2's checkpoint
    assert not (tmp_path / "rank0.json").exists() and (tmp_path / "checkpoints" / "checkpoint-2").is_dir()
    resumed = torchrun(server, grpo_data, "resume", "killed", tmp_path)
    for rank in range(2):
        assert resumed[rank]["losses"] == {k: v for k, v in runs[rank]["losses"].items() if k in ("3", "4")}
        for step in (2, 3):  # the rollouts generated after the resume are the uninterrupted run's
            again, first = recorded(tmp_path, step, rank), recorded(out, step, rank)
            assert all(torch.equal(again[k], first[k]) for k in ("prompt_ids", "completion_ids", "advantages"))
    trained, continued = params(out), params(tmp_path)
    assert all(torch.equal(trained[k], continued[k]) for k in trained)


@pytest.mark.parametrize("mode", ["zero3", "fsdp"])
def test_a_step_with_a_text_only_rank_does_not_hang_under_sharded_data_parallelism(server, grpo_data, tmp_path,
                                                                                     mode):
    runs = torchrun(server, grpo_data, mode, f"sharded-{mode}", tmp_path)
    assert sorted(runs[0]["losses"]) == ["1", "2", "3", "4"]
    # the case that hangs without collective-safe packs: one rank's prompts without an image, the other's with
    images = [[bool(recorded(tmp_path, s, r).get("num_images") and any(recorded(tmp_path, s, r)["num_images"]))
               for r in range(2)] for s in range(4)]
    assert [True, False] in images or [False, True] in images, images


def test_grpo_settings_the_face_cannot_honour_are_refused_naming_them(tmp_path):
    from trl import GRPOConfig

    from packfeed.client.stream.channel import PackfeedError
    from packfeed.client.frameworks.trl import check_grpo_config

    good = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                report_to=[], bf16=False)
    check_grpo_config(GRPOConfig(**good))
    for field, value in [("loss_type", "bnpo"), ("num_iterations", 2), ("importance_sampling_level", "sequence"),
                         ("top_entropy_quantile", 0.5), ("entropy_coef", 0.01), ("steps_per_generation", 2),
                         ("shuffle_dataset", False), ("chat_template_kwargs", {"enable_thinking": False})]:
        with pytest.raises(PackfeedError, match=field):
            check_grpo_config(GRPOConfig(**{**good, field: value}))
    check_grpo_config(GRPOConfig(**good, use_vllm=True, vllm_mode="colocate"))  # tests/test_vllm_rollouts.py runs it
    vllm = {**good, "use_vllm": True}
    for field, value, why in [("vllm_mode", "server", "preprocesses them a second time"),
                              ("vllm_tensor_parallel_size", 2, "generates that rank's prompts"),
                              ("vllm_enable_sleep_mode", True, "False")]:
        with pytest.raises(PackfeedError, match=f"{field}: give .*{why}"):
            check_grpo_config(GRPOConfig(**{**vllm, field: value}))


def test_more_steps_than_the_prompt_job_holds_and_other_families_are_refused(server, grpo_data, tmp_path):
    from trl import GRPOConfig

    from packfeed.client.stream.channel import PackfeedError
    from packfeed.client.frameworks.trl import PackfeedGRPOTrainer

    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                        report_to=[], bf16=False, max_steps=1000, num_train_epochs=1)
    with pytest.raises(PackfeedError, match=r"max_steps=1000 is past the prompt job's 8 steps"):
        PackfeedGRPOTrainer(model=None, reward_funcs=[], args=config, target=server.target, job="too-long",
                            family="qwen2_vl")
    with pytest.raises(PackfeedError, match="family 'internvl'"):
        PackfeedGRPOTrainer(model=None, reward_funcs=[], args=config, target=server.target, job="too-long",
                            family="internvl")


def test_a_loss_driven_prompt_mixture_gets_each_datasets_rewards_from_the_face(tmp_path):
    """Prompts from a mixture whose weights follow a softmax rule, DP 2 under torchrun: every rank reports, every
    step, minus the mean reward of each dataset's responses (its own, of TRL's gathered rewards), and the job decides
    the same windows as two hand-written ranks reporting what each rank's reward function itself returned for the
    same prompts."""
    import threading

    import grpc
    import yaml

    from hf_models import family_dataset, tiny_model
    from packfeed.client import LocalServer, PackStream
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    datasets = {}
    for seed, name in enumerate(("easy", "hard")):
        data = family_dataset(tmp_path / name, "qwen2_vl", seed=seed, samples=10, prefix=f"{name}-")
        datasets[name] = {"index": f"{name}/index.parquet", "weights": {0.0: 0.5, 1.0: 0.5}}
    tiny_model("qwen2_vl", data).save_pretrained(data.index.parent / "model")
    rule = {"name": "softmax", "temperature": 1.0, "min_weight": 0.01, "max_weight": 0.99, "wait_s": 120}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"name": "mix", "samples": 16, "rule": rule,
                                                       "datasets": datasets}))
    out = tmp_path / "run"
    out.mkdir()
    # a step is 2 prompts a rank: windows of 4 samples are a step each, 4 in the epoch
    plan = {"dp": 2, "microbatches": 1, "strategy": "length-group", "samples_per_pack": 2, "window": 4}
    with LocalServer(None, workers=1, extra_args=["--mixture", str(tmp_path / "mix.yaml"), "--live-spool",
                                                  str(tmp_path / "spool")]) as server:
        torchrun(server, data, "mixture", "rl", out, PACKFEED_TEST_WINDOW="4")
        scored = [json.loads((out / f"rewards-r{rank}.json").read_text()) for rank in range(2)]
        problems: list[str] = []

        def by_hand(rank: int) -> None:
            with PackStream(server.target, job="by-hand", rank=rank, dataset="mix", seed=7, prefetch=1,
                            **plan) as stream:
                for step, rewards in zip(stream, scored[rank]):
                    if sorted(step.sample_keys) != sorted(rewards):  # the same prompts: the same windows so far
                        problems.append(f"rank {rank} step {step.step}: {step.sample_keys} vs {sorted(rewards)}")
                    losses: dict[str, list[float]] = {}
                    for key, source in zip(step.sample_keys, step.sample_sources):
                        losses.setdefault(source, []).extend(-r for r in rewards[key])
                    stream.report({s: sum(v) / len(v) for s, v in losses.items()},
                                  {s: float(len(v)) for s, v in losses.items()})

        ranks = [threading.Thread(target=by_hand, args=(rank,)) for rank in range(2)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(timeout=300)
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        infos = [stub.GetJob(pb.GetJobRequest(job=job)).mixture for job in ("rl-prompts", "by-hand")]
    assert not problems and [len(steps) for steps in scored] == [4, 4], (problems, scored)
    for info in infos:
        assert not info.reports_ignored and info.windows_on_partial_reports == 0, info
        assert [(d.epoch, d.window) for d in info.decided] == [(0, w) for w in range(4)], info.decided
    face, hand = ([dict(d.weights) for d in info.decided] for info in infos)
    # the dataset scored worse gets more weight once a window's losses are in (its rewards are float32 in TRL)
    assert face[-1]["hard"] > 0.5 + 1e-3 and all(w["hard"] >= 0.5 - 1e-9 for w in face), face
    for ours, theirs in zip(face, hand):
        assert ours == pytest.approx(theirs, abs=1e-6)


def test_a_model_built_from_a_config_gets_its_reference_model_from_its_own_weights(tmp_path):
    """beta > 0 with a model built from a config (`model_config`, as the examples do): TRL builds the reference
    from `config._name_or_path`, empty for such a model ("Repo id must use alphanumeric chars ... ''"). The face
    saves the initial weights under the output folder and names them there: TRL's own loader then builds a
    reference equal to the policy."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from trl import GRPOConfig
    from trl.trainer.utils import create_model_from_path, get_config_model_id

    from hf_models import family_dataset, tiny_sizes
    from packfeed.client.model.hf import model_config
    from packfeed.client.frameworks.trl import reference_of_built_model

    conventions = family_dataset(tmp_path / "data", "qwen2_vl", seed=0, samples=4).conventions
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", conventions, **tiny_sizes("qwen2_vl")))
    assert get_config_model_id(model.config) == ""
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, use_cpu=True,
                      report_to=[], bf16=False, beta=0.04)
    reference_of_built_model(model, args)
    reference = create_model_from_path(get_config_model_id(model.config), dtype=model.dtype)
    policy, ref = model.state_dict(), reference.state_dict()
    assert policy.keys() == ref.keys() and all(torch.equal(policy[k], ref[k]) for k in policy)
    untouched = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", conventions, **tiny_sizes("qwen2_vl")))
    reference_of_built_model(untouched, GRPOConfig(output_dir=str(tmp_path / "b"), beta=0.0, use_cpu=True,
                                                   report_to=[], bf16=False, per_device_train_batch_size=2,
                                                   num_generations=2))
    assert get_config_model_id(untouched.config) == ""  # beta 0: no reference, nothing saved
