"""Context parallelism for a `transformers` Qwen2-VL: a tiny random model at CP 2, packs of degrees 1 and 2 in one
step, gives the loss and every gradient of the same model running the same packs unsplit the way
`transformers` runs them (`to_hf_inputs`, the model's own forward), within 1e-5; a wrong chunk order does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from spawned import spawn

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hf_models import family_dataset, tiny_model  # noqa: E402
from trainer_workers import cp_step  # noqa: E402

from packfeed.client.model.context_parallel import whole_packs  # noqa: E402

TOKENS = 80  # per GPU: the dataset's samples are 59-121 tokens, the longer run at degree 2


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    return family_dataset(tmp_path_factory.mktemp("qwen-cp"), "qwen2_vl", samples=20)


def degrees_1_and_2(index, tmp_path: Path, cp: int = 2) -> Path:
    """Each lane's shares of a DP 1 x CP 2 job (M 2): a step whose packs run at degree 2, one of them with an
    image its second GPU encodes, followed by a step at degree 1, as one step of 4 packs."""
    from packfeed.client import LocalServer, PackStream

    with LocalServer(index, workers=1) as server:
        lanes = []
        for lane in range(cp):
            with PackStream(server.target, job="qwen-cp", rank=0, cp_rank=lane, dp=1, microbatches=2, seed=0,
                            context_parallel=cp, max_tokens_per_gpu=TOKENS) as stream:
                lanes.append(list(stream))
    split = next(k for k, step in enumerate(lanes[0]) if all(int(p.cp[0]) == 2 for p in step.packs)
                 and any(len(p.cp_pieces) and int(p.cp_pieces.view(-1, 5)[:, 4].max()) == 1 for p in step.packs))
    whole = next(k for k, step in enumerate(lanes[0]) if all(int(p.cp[0]) == 1 for p in step.packs))
    chosen = {}
    for lane, steps in enumerate(lanes):
        step = steps[split]
        step.packs = steps[split].packs + steps[whole].packs
        for pack in step.packs:
            pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
        chosen[0, lane] = step
    torch.save(chosen, tmp_path / "steps.pt")
    return tmp_path / "steps.pt"


def unsplit(steps_file: Path, data, cp: int) -> tuple[float, dict]:
    """The packs joined and run whole by the model's own forward (Packfeed's varlen attention)."""
    from packfeed.client.model.hf import register_varlen_attention, to_hf_inputs

    model = tiny_model("qwen2_vl", data, attention=register_varlen_attention())
    lanes = torch.load(steps_file, weights_only=False)
    loss_total = 0.0
    for m in range(len(lanes[0, 0].packs)):
        for pack in whole_packs([lanes[0, lane].packs[m] for lane in range(cp)]):  # degree 1: lane 1's own
            loss = model(**to_hf_inputs(pack, "qwen2_vl", conventions=data.conventions, attention="varlen")).loss
            loss.backward()
            loss_total += float(loss.detach())
    return loss_total, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_cp(steps_file: Path, data, cp: int, tmp_path: Path, control: bool = False) -> dict:
    out = tmp_path / ("control" if control else "run")
    out.mkdir()
    spawn(cp_step, args=(cp, 1, cp, str(out / "init"), str(steps_file), str(out), control,
                         data.conventions.SerializeToString()), nprocs=cp, join=True)
    return torch.load(out / "cp.pt", weights_only=False)


def test_qwen2_vl_context_parallel_gives_the_unsplit_loss_and_gradients(qwen_data, tmp_path):
    steps_file = degrees_1_and_2(qwen_data.index, tmp_path)
    loss, grads = unsplit(steps_file, qwen_data, 2)
    got = run_cp(steps_file, qwen_data, 2, tmp_path)
    assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert {name for name in grads} <= set(got["grads"])
    vision = [name for name in grads if ".visual." in name]
    assert vision and all(grads[name].abs().sum() > 0 for name in vision[:3]), "the vision tower got no gradient"
    for name, grad in got["grads"].items():
        expected = grads.get(name, torch.zeros_like(grad))
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=name)
    control = run_cp(steps_file, qwen_data, 2, tmp_path, control=True)
    assert abs(control["loss"] - loss) > 1e-4, "a wrong chunk order gave the unsplit loss"


def test_packfeed_train_qwen2_vl_cp2_equals_its_packs_whole_on_one_process(qwen_data, tmp_path):
    """`packfeed train --nproc 2 model.hf=qwen2_vl parallel.cp=2` against the same CP plan's packs joined and
    trained whole on one process (parallel.cp=2 parallel.train_cp_packs=whole): the same losses, step by step."""
    from trainer_workers import packfeed_train

    common = ["model.hf=qwen2_vl", f"data.index={qwen_data.index}", "parallel.pp=1", "data.microbatches=2",
              f"data.max_tokens_per_gpu={TOKENS}", "optim.steps=2", "optim.warmup_steps=1", "data.server_workers=1",
              "model.hf_config={text: {hidden_size: 32, num_hidden_layers: 2}}"]
    log, split = packfeed_train(2, common + ["parallel.cp=2"], tmp_path / "cp2")
    assert "context parallelism: 2 GPU(s) per replica" in log
    _, whole = packfeed_train(1, common + ["parallel.cp=2", "parallel.train_cp_packs=whole"], tmp_path / "cp1")
    assert len(split) == len(whole) == 2
    assert any(d == 2 for r in split for _, _, d, *_ in r["cp_packs"])
    # the second step comes after one AdamW update (later ones scale each near-zero gradient by its own size,
    # which turns rounding into visible differences)
    for a, b in zip(split, whole):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_other_hugging_face_families_are_refused_with_context_parallelism():
    from packfeed.trainer.config import load_config

    with pytest.raises(ValueError, match="not internvl"):
        load_config(None, ["model.hf=internvl", "parallel.cp=2", "parallel.pp=1", "data.index=x"])
    with pytest.raises(ValueError, match="pipelines with context parallelism are not supported"):
        load_config(None, ["model.hf=qwen2_vl", "parallel.cp=2", "parallel.pp=2", "data.index=x"])


def test_the_gpus_of_a_pack_encode_a_videos_pieces_as_the_whole_video_encodes_them(tmp_path):
    """Qwen2-VL videos over 8 GPUs: each GPU runs the vision tower on its pieces alone (whole temporal patches of
    a video, `cp_pieces`), and the pieces' features, in `cp_pieces` order, are the whole pack's items' features."""
    pytest.importorskip("av")
    import numpy as np
    from test_hf_video import built_packs, video_family

    from packfeed.client.model.context_parallel import share_qwen_pixels
    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.serve.cp_shares import cp_shares
    from packfeed.server.serve.wire import encode_pack

    data = video_family(tmp_path, "qwen2_vl")
    visual = tiny_model("qwen2_vl", data).model.visual
    pack = built_packs(data, [[4, 5, 6, 7]])[0]  # videos of each container, a frame sequence

    def features(of) -> torch.Tensor:
        patches, grids, _ = share_qwen_pixels(of, "qwen2_vl", data.conventions)
        return visual(patches, grid_thw=grids).pooler_output if len(grids) else torch.zeros(0)  # merged

    with torch.no_grad():
        expected = features(pack_of(encode_pack(pack, 1, False)))
        n = len(pack.sample_keys)
        temporal = data.conventions.image_policy.temporal_patch_size
        shares = [pack_of(encode_pack(s, 1, False)) for s in cp_shares(pack, np.full(n, 8), np.zeros(n, np.int64),
                                                                       8, temporal)]
        encoded = [iter(features(share).split(1)) for share in shares]
    pieces = shares[0].cp_pieces.view(-1, 5).tolist()
    assert all(share.cp_pieces.view(-1, 5).tolist() == pieces for share in shares)
    got = torch.cat([torch.cat([next(encoded[rank]) for _ in range(tokens)]) for _, _, _, tokens, rank in pieces])
    assert torch.allclose(got, expected, atol=1e-5)
    assert len({p[0] for p in pieces}) < len(pieces), "no video was shared out over GPUs"
    assert all(first % temporal == 0 for _, first, _, _, _ in pieces)
    # the control: a video's pieces in the wrong order give other features
    if len(pieces) > 1:
        swapped = [pieces[1], pieces[0]] + pieces[2:]
        encoded = [iter(features(share).split(1)) for share in shares]
        with torch.no_grad():
            wrong = torch.cat([torch.cat([next(encoded[r]) for _ in range(t)]) for _, _, _, t, r in swapped])
        assert not torch.allclose(wrong, expected, atol=1e-5)
