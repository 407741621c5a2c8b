"""Loss reports from the framework faces (docs/planning.md "Weights the loss moves"): `PackfeedTrainer` and
`PackfeedSFTTrainer` on a loss-driven mixture report every step's loss per dataset by themselves, and the job decides
the same windows as a hand-written loop that reads the same model's losses per sample and reports them with `PackStream.report`."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")  # PackfeedSFTTrainer's

from hf_models import family_dataset, tiny_model  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402
from packfeed.client.stream.tensors import IGNORE_INDEX  # noqa: E402

# weights a smooth function of the losses (no bound reached): equal decisions mean equal reports
RULE = {"name": "softmax", "temperature": 1.0, "min_weight": 0.01, "max_weight": 0.99, "max_change": 1.0,
        "wait_s": 600}  # the faces report every step: nothing waits, but a job left unreported would wait this long
WINDOW = 10  # samples: 4 windows of 40, windows 2 and 3 decided by the losses
PLAN = {"dp": 1, "microbatches": 2, "window": WINDOW, "token_cap": 256, "vision_cap": 256}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Two datasets of the qwen2_vl conventions (one tokenizer), in a mixture of 40 samples with a softmax rule."""
    root = tmp_path_factory.mktemp("mixture_reports")
    datasets = {}
    for seed, (name, images) in enumerate({"ocr": (1, 2, 1), "chat": (0, 0, 1)}.items()):
        data = family_dataset(root / name, "qwen2_vl", seed=seed, samples=12, image_counts=images)
        datasets[name] = {"index": f"{name}/index.parquet", "weights": {0.0: 0.5, 1.0: 0.5}}
    path = root / "learn.yaml"
    path.write_text(yaml.safe_dump({"name": "learn", "samples": 40, "rule": RULE, "datasets": datasets}))
    return path, data


def by_hand(model, step) -> tuple[dict[str, float], dict[str, float]]:
    """A step's mean next-token loss per dataset over its loss tokens, sample by sample from the pack's bounds."""
    sums: dict[str, list[float]] = {}
    for pack in step.packs:
        if pack.empty:
            continue
        inputs = to_hf_inputs(pack, "qwen2_vl")
        logp = torch.log_softmax(model(**inputs).logits[0].double(), -1)
        ids, labels, bounds = pack.input_ids.long(), pack.labels.long(), pack.cu_seqlens.tolist()
        for k, source in enumerate(pack.sample_sources):
            picked = [-float(logp[j - 1, ids[j]]) for j in range(bounds[k] + 1, bounds[k + 1])
                      if labels[j] != IGNORE_INDEX]
            entry = sums.setdefault(source, [0.0, 0])
            entry[0] += sum(picked)
            entry[1] += len(picked)
    return ({name: total / n for name, (total, n) in sums.items() if n},
            {name: float(n) for name, (_, n) in sums.items() if n})


def test_the_hf_trainer_reports_each_steps_loss_per_dataset_as_a_hand_written_loop_does(tmp_path, mixture):
    import grpc
    import transformers

    from packfeed.client import LocalServer, PackStream
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, packfeed_training_arguments
    from packfeed.client.frameworks.sft_trainer import PackfeedSFTTrainer, packfeed_sft_config
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    path, data = mixture
    with LocalServer(None, workers=1, extra_args=["--mixture", str(path)]) as server:
        model = tiny_model("qwen2_vl", data)
        with PackStream(server.target, job="silent", rank=0, dataset="learn", prefetch=1, **PLAN) as stream:
            with pytest.warns(RuntimeWarning, match="step 0:0 was not reported"):  # its windows would wait
                next(stream), next(stream)
        steps = 0
        with PackStream(server.target, job="by-hand", rank=0, dataset="learn", prefetch=1, **PLAN) as stream:
            assert stream.loss_driven
            with torch.no_grad():
                for step in stream:
                    stream.report(*by_hand(model, step))
                    steps += 1
        with PackStream(server.target, job="trainer", rank=0, dataset="learn", prefetch=1, **PLAN) as stream:
            # learning rate 0: the model stays the one the loop above read, so the losses must be the same
            args = packfeed_training_arguments(stream, output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                               max_steps=steps, learning_rate=0.0, save_strategy="no")
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*was not reported")  # the face reports every step
                PackfeedTrainer(model=model, args=args, stream=stream, family="qwen2_vl").train()
        with PackStream(server.target, job="sft", rank=0, dataset="learn", prefetch=1, **PLAN) as stream:
            # TRL's SFTTrainer: its fused LM head gives log-probabilities, not logits
            config = packfeed_sft_config(stream, output_dir=str(tmp_path / "sft"), report_to=[], use_cpu=True,
                                         max_steps=steps, learning_rate=0.0, save_strategy="no")
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(data.tokenizer))
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*was not reported")
                PackfeedSFTTrainer(model=model, args=config, stream=stream, family="qwen2_vl",
                                   processing_class=tokenizer).train()
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        infos = [stub.GetJob(pb.GetJobRequest(job=job)).mixture for job in ("by-hand", "trainer", "sft")]
        # the silent job's next window waits for reports (wait_s 600): SIGTERM still stops the server, not a kill
        server.stop(timeout=120)
        assert server.process.returncode == 0, server.process.returncode
    for info in infos:
        assert info.rule == "softmax" and not info.reports_ignored and info.windows_on_partial_reports == 0, info
    hand, *faces = [[dict(d.weights) for d in info.decided] for info in infos]
    assert len(hand) == 40 // WINDOW
    assert hand[2]["ocr"] != pytest.approx(0.5, abs=1e-3)  # window 2 on: the losses', not the schedule's
    for face in faces:
        assert len(face) == len(hand)
        for ours, theirs in zip(face, hand):
            assert ours == pytest.approx(theirs, abs=1e-6)


def test_a_grpo_steps_report_is_minus_each_datasets_mean_reward_without_unscored_responses():
    from packfeed.client.model.dataset_losses import reward_losses

    losses, counts = reward_losses(["math", "math", "chat", "chat", "ocr"], [1.0, 0.5, 0.25, float("nan"), float("nan")])
    assert losses == {"math": -0.75, "chat": -0.25} and counts == {"math": 2.0, "chat": 1.0}  # ocr: none scored
    assert reward_losses([], []) == ({}, {})
