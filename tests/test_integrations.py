"""Framework integrations at DP 2 under torchrun (gloo; its ranks forked preloaded, `forked_torchrun`), each against
the plain `PackStream` loop on the same job (DDP, SGD, clipping; tests/integration_worker.py): `PackfeedTrainer`
(`transformers.Trainer`), TRL's `SFTTrainer` through the same mixin, and Lightning's `PackDataModule`. For each: the
same losses step by step (within 1e-5) and the same samples; a checkpoint, then a restart in new processes lands on
exactly the next step's samples and losses; the control (the framework's own resume without the stream's state: the
Trainer's, which DeepSpeed's run shares, and Lightning's) starts the data over, so the check can fail. Arguments
that contradict Packfeed's steps are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forked_torchrun import torchrun as forked_torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "integration_worker.py"
STEPS = 4


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    from hf_models import family_dataset

    return family_dataset(tmp_path_factory.mktemp("integrations"), "qwen2_vl", samples=24)


@pytest.fixture(scope="module")
def server(qwen_data):
    from packfeed.client import LocalServer

    with LocalServer(qwen_data.index, workers=1) as running:
        yield running


def torchrun(server, data, job: str, mode: str, checkpoints: Path, out: Path) -> list[dict]:
    """`torchrun --nproc-per-node 2 integration_worker.py ...`, its ranks forked preloaded (`forked_torchrun`)."""
    forked_torchrun(WORKER, [server.target, job, mode, STEPS, checkpoints, out], out,
                    env={"PACKFEED_TEST_TOKENIZER": str(data.tokenizer)})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def plain(server, qwen_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    runs = torchrun(server, qwen_data, "plain", "plain", out / "unused", out)
    assert runs[0]["keys"] != runs[1]["keys"] and len(runs[0]["keys"]) == STEPS  # each rank its own packs
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]  # it learns
    return runs


def check_resume(plain, straight, resumed, control, logged_before: int) -> None:
    """`straight` trained as `plain`; `resumed` (from step 2) continued it exactly; `control` (when run) started
    over. `logged_before`: the losses of the first steps the resumed run's log carries from its checkpoint."""
    for rank in range(2):
        assert straight[rank]["keys"] == plain[rank]["keys"]
        assert resumed[rank]["keys"] == straight[rank]["keys"][2:]
        if control is not None:
            assert control[rank]["keys"] == straight[rank]["keys"][:2] != resumed[rank]["keys"]
    assert straight[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)
    assert resumed[0]["losses"] == pytest.approx(straight[0]["losses"][2 - logged_before:], rel=1e-5)


@pytest.mark.slow
def test_the_hf_trainer_trains_as_the_plain_loop_and_resumes_at_the_next_step(tmp_path, server, qwen_data, plain):
    runs = {mode: torchrun(server, qwen_data, "trainer", mode, tmp_path / "checkpoints", tmp_path / mode)
            for mode in ("train", "resume", "control")}
    assert (tmp_path / "checkpoints" / "checkpoint-2" / "packfeed_stream_rank1.json").is_file()
    # the resumed Trainer's log holds the checkpoint's two steps, then its own: the weights came back too
    check_resume(plain, runs["train"], runs["resume"], runs["control"], logged_before=2)


@pytest.mark.slow
def test_the_hf_trainer_under_deepspeed_zero3_trains_as_the_plain_loop_and_resumes_at_the_next_step(
        tmp_path, server, qwen_data, plain):
    """`packfeed_training_arguments(stream, deepspeed={... ZeRO-3 ...})`: DeepSpeed shards the parameters over
    the two ranks (its CPU accelerator, gloo) and trains as the plain loop; a restart from its checkpoint lands on
    the next step's samples and losses. The stream's state goes through the same Trainer callback as without
    DeepSpeed, whose test runs the control (a resume without it starts the data over)."""
    pytest.importorskip("deepspeed")
    runs = {mode: torchrun(server, qwen_data, "zero3", f"zero3-{mode}", tmp_path / "checkpoints", tmp_path / mode)
            for mode in ("train", "resume")}
    checkpoint = tmp_path / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "packfeed_stream_rank1.json").is_file()
    shards = sorted(path.name for path in (checkpoint / "global_step2").glob("zero_pp_rank_*_model_states.pt"))
    assert len(shards) == 2  # DeepSpeed's ZeRO ran (a shard of the model per rank), not a silent fallback
    assert all(run["ensure_encoders"] for run in runs["train"])  # every pack runs the tower under ZeRO-3
    log = (tmp_path / "train" / "torchrun.log").read_text()
    # Accelerate's expected "GradientAccumulationPlugin has 1, DeepSpeed config has 2" (the Trainer accumulates)
    assert "Gradient accumulation steps mismatch" not in log
    check_resume(plain, runs["train"], runs["resume"], None, logged_before=2)


@pytest.mark.slow
def test_trl_sft_trainer_trains_as_the_plain_loop(tmp_path, server, qwen_data, plain):
    """TRL's SFTTrainer computes its loss its own way (a fused LM head over log-probabilities), which differs from
    the model's own by a few 1e-6 on the same weights: the first step's loss equals the plain loop's within 1e-5;
    the later steps, each after an update from those gradients, stay within 3e-5 (measured: 0.8-1.1e-5)."""
    pytest.importorskip("trl")
    sft = torchrun(server, qwen_data, "sft", "sft", tmp_path / "checkpoints", tmp_path / "sft")
    assert (tmp_path / "checkpoints" / "checkpoint-2" / "packfeed_stream_rank0.json").is_file()
    for rank in range(2):
        assert sft[rank]["keys"] == plain[rank]["keys"]
    assert sft[0]["losses"][0] == pytest.approx(plain[0]["losses"][0], rel=1e-5)
    trained = [sum(sum(sft[r]["tokens"][:k + 1]) for r in range(2)) for k in range(STEPS)]
    assert sft[0]["num_tokens"] == trained and trained[0] > 100  # tokens over the ranks, not a count of packs
    assert sft[0]["losses"] == pytest.approx(plain[0]["losses"], rel=3e-5)


@pytest.mark.slow
def test_lightning_trains_as_the_plain_loop_and_resumes_at_the_next_step(tmp_path, server, qwen_data, plain):
    pytest.importorskip("lightning")
    runs = {mode: torchrun(server, qwen_data, "lightning", f"lightning-{mode}", tmp_path / "ckpt", tmp_path / mode)
            for mode in ("train", "resume", "control")}
    check_resume(plain, runs["train"], runs["resume"], runs["control"], logged_before=0)


@pytest.mark.slow
def test_the_hf_trainer_example_runs_with_trl(tmp_path, server, qwen_data):
    """examples/hf_trainer.py with `--trl` (TRL's SFTTrainer), as a user runs it (one process), for two optimizer
    steps; tests/test_examples.py runs every example's commands as written."""
    pytest.importorskip("trl")
    script = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
    done = subprocess.run([sys.executable, str(script), server.target, str(tmp_path / "out"), "--steps", "2",
                           "--trl", "--tokenizer", str(qwen_data.tokenizer)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-2" / "packfeed_stream_rank0.json").is_file()


def test_arguments_that_contradict_packfeed_steps_are_refused(server, tmp_path):
    import transformers

    from hf_models import tiny_sizes
    from packfeed.client import PackfeedError, PackStream
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, job_steps, packfeed_training_arguments
    from packfeed.trainer.models.hf.build import build_hf_model

    with PackStream(server.target, job="args", rank=0, dp=1, microbatches=2, epochs=2) as stream:
        args = packfeed_training_arguments(stream, output_dir=str(tmp_path), report_to=[], use_cpu=True)
        assert args.gradient_accumulation_steps == 2 and args.ignore_data_skip
        assert args.max_steps == job_steps(stream) == 2 * stream.info.steps_per_epoch > 0
        with pytest.raises(PackfeedError, match="gradient_accumulation_steps=4 contradicts"):
            packfeed_training_arguments(stream, output_dir=str(tmp_path), gradient_accumulation_steps=4)
        model = build_hf_model("qwen2_vl", stream.conventions, tiny_sizes("qwen2_vl"))
        wrong = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                               gradient_accumulation_steps=3)
        with pytest.raises(PackfeedError, match="the job's M is 2.*ignore_data_skip"):
            PackfeedTrainer(model=model, args=wrong, stream=stream, family="qwen2_vl")
        trainer = PackfeedTrainer(model=model, args=args, stream=stream, family="qwen2_vl")
        with pytest.raises(PackfeedError, match="was not saved by a PackfeedTrainer"):
            trainer.train(resume_from_checkpoint=str(tmp_path))


def test_a_model_that_does_not_fit_the_dataset_is_refused_before_its_first_forward(server, tmp_path):
    """A vocabulary smaller than the dataset's or another image placeholder id: `to_hf_inputs(..., model=)`,
    `PackfeedTrainer` and `PackDataModule` refuse it, naming the field and both values, before any forward (the
    Lightning module's training_step fails the test if it runs)."""
    import lightning
    import torch

    from hf_models import tiny_sizes
    from packfeed.client import PackStream
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, packfeed_training_arguments
    from packfeed.client.frameworks.lightning import PackDataModule
    from packfeed.trainer.models.hf.build import build_hf_model

    with PackStream(server.target, job="misfit", rank=0, dp=1, microbatches=2, epochs=1) as stream:
        conventions, sizes = stream.conventions, tiny_sizes("qwen2_vl")
        fits = build_hf_model("qwen2_vl", conventions, sizes)
        small = build_hf_model("qwen2_vl", conventions, {**sizes, "text": {**sizes["text"],
                                                                           "vocab_size": conventions.vocab_size - 7}})
        other = build_hf_model("qwen2_vl", conventions, sizes)
        other.config.image_token_id = conventions.image_context_id - 1
        misfits = [(small, "vocabulary", conventions.vocab_size - 7, conventions.vocab_size),
                   (other, "image_token_id", conventions.image_context_id - 1, conventions.image_context_id)]
        args = packfeed_training_arguments(stream, output_dir=str(tmp_path), report_to=[], use_cpu=True)
        pack = next(iter(stream)).packs[0]
        assert to_hf_inputs(pack, "qwen2_vl", conventions=conventions, model=fits)["input_ids"].shape[1] > 0
        for model, field, mine, theirs in misfits:
            for refuse in (lambda: PackfeedTrainer(model=model, args=args, stream=stream, family="qwen2_vl"),
                           lambda: to_hf_inputs(pack, "qwen2_vl", conventions=conventions, model=model)):
                with pytest.raises(ValueError, match=field) as refused:
                    refuse()
                assert f"{mine}" in str(refused.value) and f"{theirs}" in str(refused.value)

    class Untrainable(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            raise AssertionError("a forward ran on a model that does not fit the dataset")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for model, field, mine, theirs in misfits:
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2,
                                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    num_sanity_val_steps=0, default_root_dir=str(tmp_path))
        data = PackDataModule(server.target, job=f"misfit-{field}", family="qwen2_vl", microbatches=2, epochs=1)
        with pytest.raises(ValueError, match=field):
            trainer.fit(Untrainable(model), datamodule=data)


def test_the_frameworks_speak_the_jobs_terms_and_refuse_what_cannot_hold(server, tmp_path):
    """`num_train_epochs` other than the job's and `max_steps` past its end are refused (Trainer and Lightning);
    the Trainer's logs carry the job's epoch and step k of N, continuous over a resume, and `packfeed_step` is
    the step trained; Lightning resumes mid-job without its "not resumable" warning and logs the same terms."""
    import warnings

    import lightning
    import torch
    import transformers

    from hf_models import tiny_sizes
    from packfeed.client import PackfeedError, PackStream
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, job_steps, packfeed_training_arguments
    from packfeed.client.frameworks.lightning import PackDataModule, PackProgress
    from packfeed.trainer.models.hf.build import build_hf_model

    class Logged(transformers.TrainerCallback):
        def __init__(self):
            self.logs, self.keys = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.logs.append(logs)

        def on_step_end(self, args, state, control, **kwargs):
            self.keys.append(list(kwargs["train_dataloader"].step.sample_keys))

    def trainer_for(stream, steps: int, callback):
        args = packfeed_training_arguments(stream, output_dir=str(tmp_path / "hf"), report_to=[], use_cpu=True,
                                           max_steps=steps, save_steps=2, logging_steps=1, learning_rate=1e-3)
        model = build_hf_model("qwen2_vl", stream.conventions, tiny_sizes("qwen2_vl"))
        return PackfeedTrainer(model=model, args=args, stream=stream, family="qwen2_vl", callbacks=[callback])

    with PackStream(server.target, job="terms", rank=0, dp=1, microbatches=2, epochs=2) as stream:
        total, per_epoch = job_steps(stream), stream.info.steps_per_epoch
        for wrong in ({"num_train_epochs": 3}, {"max_steps": total + 1}):
            with pytest.raises(PackfeedError, match=next(iter(wrong))):
                packfeed_training_arguments(stream, output_dir=str(tmp_path), **wrong)
        assert packfeed_training_arguments(stream, output_dir=str(tmp_path), num_train_epochs=2).max_steps == total
        first = Logged()
        trainer = trainer_for(stream, 2, first)
        trainer.train()
        trained = trainer.packfeed_step
    with PackStream(server.target, job="terms", rank=0, dp=1, microbatches=2, epochs=2) as stream:
        second = Logged()
        trainer_for(stream, 4, second).train(resume_from_checkpoint=True)
    logs = first.logs + second.logs
    assert [log["packfeed_step"] for log in logs] == [1, 2, 3, 4] and {log["packfeed_steps"] for log in logs} == {total}
    assert [log["epoch"] for log in logs] == [round(k // per_epoch + (k % per_epoch + 1) / per_epoch, 4)
                                              for k in range(4)]
    assert (trained.epoch, trained.step) == (0, 1) and first.keys[-1] == list(trained.sample_keys)
    assert len({tuple(k) for k in first.keys + second.keys}) == 4  # four different steps' samples

    class Module(lightning.LightningModule):
        def __init__(self, data):
            super().__init__()
            self.model = build_hf_model("qwen2_vl", data.conventions, tiny_sizes("qwen2_vl"))

        def training_step(self, batch, index):
            return self.model(**batch).loss * self.trainer.accumulate_grad_batches

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def fit(steps: int, resume: str | None = None):
        data = PackDataModule(server.target, job="terms-lightning", family="qwen2_vl", microbatches=2, epochs=2)
        checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "pl"),
                                                                  every_n_train_steps=2, save_last=True)
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=steps,
                                    accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                                    num_sanity_val_steps=0, callbacks=[checkpoints, PackProgress()])
        with PackStream(server.target, job="terms-lightning", rank=0, dp=1, microbatches=2, epochs=2) as peek:
            module = Module(peek)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=data, ckpt_path=resume)
        return trainer, [str(w.message) for w in caught]

    with pytest.raises(PackfeedError, match="past the job"):
        fit(total + 1)
    fit(2)
    resumed, messages = fit(3, resume=str(tmp_path / "pl" / "last.ckpt"))
    assert not [m for m in messages if "not resumable" in m]
    assert resumed.logged_metrics["packfeed_step"] == 3 and resumed.logged_metrics["packfeed_steps"] == total
