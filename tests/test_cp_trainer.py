"""Context parallelism in the trainer: the reference VLM at cp 2 and cp 4, packs of several degrees in one step,
gives the loss and every gradient one GPU computes on the same packs unsplit (within 1e-5); a wrong chunk order
does not; and `packfeed train parallel.cp=2` starts with the loss of the same packs trained on one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from spawned import spawn

sys.path.insert(0, str(Path(__file__).parent))
from trainer_workers import SMALL_MODEL, cp_step, packfeed_train, restart_from  # noqa: E402

from packfeed.client import LocalServer, PackStream  # noqa: E402
from packfeed.client.model.context_parallel import whole_packs  # noqa: E402
from packfeed.client.stream.tensors import Step  # noqa: E402
from packfeed.trainer.models import ReferenceModel  # noqa: E402
from packfeed.trainer.models.reference import VLMConfig, run_layers  # noqa: E402
from packfeed.trainer.models.reference_inputs import microbatches_of  # noqa: E402

N = 96  # tokens per GPU: the demo's longer samples need 2 or 4 GPUs


def mixed_step(index, dp: int, cp: int, tmp_path: Path) -> Path:
    """The first step of a DP dp x CP cp job (M 2) whose packs have more than one degree and an image whose tiles
    two GPUs encode, each lane's shares."""
    lanes = {}
    with LocalServer(index, workers=1) as server:
        for rank in range(dp):
            for lane in range(cp):
                with PackStream(server.target, job=f"cp{cp}", rank=rank, cp_rank=lane, dp=dp, microbatches=2, seed=0,
                                context_parallel=cp, max_tokens_per_gpu=N) as stream:
                    lanes[rank, lane] = list(stream)
    for k in range(len(lanes[0, 0])):
        degrees = {int(p.cp[0]) for steps in lanes.values() for p in steps[k].packs if not p.empty}
        shared_out = any(len(set(p.cp_pieces.view(-1, 5)[:, 0].tolist())) < len(p.cp_pieces.view(-1, 5))
                         for steps in lanes.values() for p in steps[k].packs if not p.empty)
        if len(degrees) > 1 and shared_out:
            break
    assert len(degrees) > 1 and shared_out, "no step mixes degrees with an image encoded by two GPUs"
    chosen = {key: steps[k] for key, steps in lanes.items()}
    for step in chosen.values():
        for pack in step.packs:
            pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
    torch.save(chosen, tmp_path / "steps.pt")
    return tmp_path / "steps.pt"


def unsplit_reference(steps_file: Path, dp: int, cp: int) -> tuple[float, dict]:
    """Loss and gradients of the same packs run whole on one GPU, through the model without context parallelism."""
    lanes = torch.load(steps_file, weights_only=False)
    model = ReferenceModel(VLMConfig(**SMALL_MODEL))
    loss_total = 0.0
    for rank in range(dp):
        first = lanes[rank, 0]
        for m in range(len(first.packs)):
            for pack in whole_packs([lanes[rank, lane].packs[m] for lane in range(cp)]):
                batch = microbatches_of(Step(first.epoch, first.step, rank, [pack]), model.config)
                loss = run_layers(model.layers, batch.args)[0].sum() / pack.step_loss_tokens
                loss.backward()
                loss_total += float(loss.detach())
    return loss_total, {name: p.grad.clone() for name, p in model.layers.named_parameters()}


def run_cp(steps_file: Path, dp: int, cp: int, tmp_path: Path, control: bool = False) -> dict:
    out = tmp_path / ("control" if control else "run")
    out.mkdir()
    spawn(cp_step, args=(dp * cp, dp, cp, str(out / "init"), str(steps_file), str(out), control),
          nprocs=dp * cp, join=True)
    return torch.load(out / "cp.pt", weights_only=False)


@pytest.mark.parametrize("dp, cp", [(1, 4), (2, 2)])
def test_context_parallel_gives_the_unsplit_loss_and_gradients(small_tile_index, tmp_path, dp, cp):
    steps_file = mixed_step(small_tile_index, dp, cp, tmp_path)
    loss, grads = unsplit_reference(steps_file, dp, cp)
    got = run_cp(steps_file, dp, cp, tmp_path)
    assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert got["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(got["grads"][name], grad, rtol=1e-5, atol=1e-6), name
    if cp == 4:  # the control: rank 1 reads its chunks in the wrong order
        wrong = run_cp(steps_file, dp, cp, tmp_path, control=True)
        assert abs(wrong["loss"] - loss) > 1e-4 or any(
            not torch.allclose(wrong["grads"][name], grad, rtol=1e-4, atol=1e-5) for name, grad in grads.items())


COMMON = ["data.microbatches=2", "data.server_workers=1", "optim.steps=5", "optim.warmup_steps=1",
          "parallel.dp=1", "parallel.pp=1", f"data.max_tokens_per_gpu={N}"] + \
    [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]


def test_packfeed_train_cp2_starts_with_the_loss_of_the_same_packs_on_one_process(small_tile_index, tmp_path):
    index = f"data.index={small_tile_index}"
    log, split = packfeed_train(2, COMMON + [index, "parallel.cp=2", "checkpoint.every=2"], tmp_path / "cp2")
    assert "context parallelism: 2 GPU(s) per replica" in log
    _, whole = packfeed_train(1, COMMON + [index, "parallel.cp=2", "parallel.train_cp_packs=whole"], tmp_path / "cp1")
    assert len(split) == len(whole) == 5
    for a, b in zip(split, whole):
        assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # later steps after AdamW steps: equal gradients
        assert a["tokens"] == b["tokens"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # every step lists its packs (degree, GPUs, sizes), and the simulator predicts each from them
    assert all({d for _, _, d, *_ in r["cp_packs"]} <= {1, 2} for r in split)
    assert any(d == 2 for r in split for _, _, d, *_ in r["cp_packs"])
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"vision": {"hidden": 32, "layers": 2, "heads": 2, "ffn": 128, "causal": False},
                                 "llm": {"hidden": 64, "layers": 2, "heads": 4, "ffn": 170, "gated": True,
                                         "vocab": 1024}, "patches_per_tile": 64, "tokens_per_tile": 16,
                                 "projector_params": 20000}))
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--run", str(tmp_path / "cp2"),
                           "--model", str(shape), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    steps = result["steps"]
    assert result["schedule"] == "context parallel 2" and len(steps) == 5 - 1  # every step after the first
    assert all(s["simulated_s"] > 0 and s["measured_s"] > 0 for s in steps)
    for k, step in enumerate(steps):  # calibrated leave-one-out: by the median ratio of the other steps
        others = [s["measured_s"] / s["simulated_s"] for j, s in enumerate(steps) if j != k]
        assert step["predicted_s"] == pytest.approx(step["simulated_s"] * float(np.median(others)))
    assert result["mean_abs_error"] >= 0 and result["overhead_factor"] > 0
    # restarted from its checkpoint after 2 steps, the CP run continues at exactly the next step
    restart_from(tmp_path / "cp2", tmp_path / "resumed", 2)
    log, resumed = packfeed_train(2, COMMON + [index, "parallel.cp=2", "checkpoint.every=2"], tmp_path / "resumed")
    assert "resuming from" in log
    assert [r["step"] for r in resumed[2:]] == [r["step"] for r in split[2:]] == [2, 3, 4]
    assert [r["loss"] for r in resumed[2:]] == pytest.approx([r["loss"] for r in split[2:]], rel=1e-6)
