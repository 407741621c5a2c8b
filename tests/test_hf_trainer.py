"""`packfeed.client.hf_trainer`: `transformers.Trainer` fed by a PackStream at DP 2 under torchrun (gloo): the
same losses as the plain PackStream loop (within 1e-5) on the same steps; a checkpoint, then a restart in new
processes lands on exactly the next step's samples (and losses); the control (the Trainer's own resume without
the stream's state) starts the data over, so the check can fail. Arguments that contradict Packfeed's steps are
refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "hf_trainer_worker.py"
STEPS = 4


def torchrun(target: str, job: str, mode: str, checkpoints: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), target, job, mode, str(STEPS), str(checkpoints), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    from hf_models import family_dataset

    return family_dataset(tmp_path_factory.mktemp("hf-trainer"), "qwen2_vl", samples=24)


@pytest.mark.slow
def test_the_trainer_trains_as_the_plain_loop_and_resumes_at_the_next_step(tmp_path, qwen_data):
    from packfeed.client import LocalServer

    with LocalServer(qwen_data.index, workers=1) as server:
        plain = torchrun(server.target, "plain", "plain", tmp_path / "unused", tmp_path / "plain")
        straight = torchrun(server.target, "trainer", "train", tmp_path / "checkpoints", tmp_path / "straight")
        resumed = torchrun(server.target, "trainer", "resume", tmp_path / "checkpoints", tmp_path / "resumed")
        control = torchrun(server.target, "trainer", "control", tmp_path / "checkpoints", tmp_path / "control")
    assert (tmp_path / "checkpoints" / "checkpoint-2" / "packfeed_stream_rank1.json").is_file()
    for rank in range(2):
        assert straight[rank]["keys"] == plain[rank]["keys"] and len(plain[rank]["keys"]) == STEPS
        assert resumed[rank]["keys"] == straight[rank]["keys"][2:]
        assert control[rank]["keys"][:2] == straight[rank]["keys"][:2] != resumed[rank]["keys"]
    assert plain[0]["keys"] != plain[1]["keys"]  # each rank its own packs
    assert straight[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)
    # the resumed run's log holds the checkpoint's first two steps, then its own: the weights came back too
    assert resumed[0]["losses"] == pytest.approx(straight[0]["losses"], rel=1e-5)
    assert plain[0]["losses"][-1] < plain[0]["losses"][0]  # it learns


def test_arguments_that_contradict_packfeed_steps_are_refused(qwen_data, tmp_path):
    import transformers

    from packfeed.client import LocalServer, PackfeedError, PackStream
    from packfeed.client.hf_trainer import PackfeedTrainer, job_steps, packfeed_training_arguments
    from packfeed.trainer.models.hf.build import build_hf_model
    from hf_models import tiny_sizes

    with LocalServer(qwen_data.index, workers=1) as server:
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
