"""Reference trainer pieces on real packs: the packed model, microbatch padding, partition search, recompute."""

from __future__ import annotations

import pytest
import torch
from packfeed.trainer.models.reference_inputs import microbatches_of
from packfeed.trainer.models.reference import (
    IGNORE_INDEX,
    VLMConfig,
    build_layers,
    layer_kinds,
    next_token_targets,
    run_layers,
)
from packfeed.trainer.parallel.partition import (
    candidates_around,
    evaluate,
    search_partition,
    split_by_weight,
)
from packfeed.trainer.parallel.pipeline import StageModule
from packfeed.trainer.parallel.profile import SavedBytes, profile_layers
from packfeed.trainer.parallel.recompute import adaptive_recompute, choose_keep
from trainer_workers import SMALL_MODEL


def microbatch(step, model: VLMConfig, m: int = 0) -> tuple[torch.Tensor, ...]:
    batch = microbatches_of(step, model)
    return tuple(a.tensor_split(len(step.packs))[m] for a in batch.args)


def test_padding_keeps_every_real_token_and_tile(served_steps):
    model = VLMConfig(**SMALL_MODEL)
    step = served_steps[0][0]
    batch = microbatches_of(step, model)
    pixels, input_ids, _, cu_seqlens, vision_positions, labels = batch.args
    assert batch.shape.tokens % 64 == 0
    assert batch.real_tokens == sum(p.input_ids.numel() for p in step.packs)
    for m, pack in enumerate(step.packs):
        length = pack.input_ids.numel()
        ids = input_ids.tensor_split(2)[m]
        assert torch.equal(ids[:length], pack.input_ids.long())
        assert bool((labels.tensor_split(2)[m][length:] == IGNORE_INDEX).all())
        tiles = pack.tile_shapes.shape[0]
        positions = vision_positions.tensor_split(2)[m]
        assert int((positions >= 0).sum()) == tiles * model.tokens_per_tile
        # every vision position holds an image placeholder token in the real input
        context = ids[positions[positions >= 0]]
        assert context.unique().numel() == 1
        assert int(cu_seqlens.tensor_split(2)[m][-1]) == length


def test_samples_in_a_pack_never_see_each_other(served_steps):
    """Changing every token of the pack's last sample leaves the loss contributions of the others unchanged."""
    model = VLMConfig(**SMALL_MODEL)
    step = next(s for s in served_steps[0] if len(s.packs[0].sample_keys) >= 2)
    carrier = microbatch(step, model)
    layers = build_layers(model)
    cu = carrier[3]
    last_start = int(cu[-2]) if int(cu[-1]) == int(cu[-2]) else int(cu[len(step.packs[0].sample_keys) - 1])

    def hidden_of(ids):
        text = run_layers(layers[:-1], (carrier[0], ids, *carrier[2:]))
        return text[0].detach()

    before = hidden_of(carrier[1])
    changed = carrier[1].clone()
    changed[last_start:int(cu[len(step.packs[0].sample_keys)])] = 7
    after = hidden_of(changed)
    torch.testing.assert_close(after[:last_start], before[:last_start])
    assert not torch.allclose(after[last_start:int(cu[-1])], before[last_start:int(cu[-1])])


def test_next_token_targets_stay_inside_each_sample():
    labels = torch.tensor([IGNORE_INDEX, 5, 6, IGNORE_INDEX, 8, 9, IGNORE_INDEX])
    cu_seqlens = torch.tensor([0, 3, 6, 6])
    assert next_token_targets(labels, cu_seqlens).tolist() == [5, 6, IGNORE_INDEX, 8, 9, IGNORE_INDEX,
                                                                IGNORE_INDEX]


def test_loss_counts_exactly_the_servers_loss_tokens(served_steps):
    """The trainer's per-token loss covers exactly the pack's loss tokens (what step_loss_tokens sums)."""
    model = VLMConfig(**SMALL_MODEL)
    for step in served_steps[0]:
        for m, pack in enumerate(step.packs):
            carrier = microbatch(step, model, m)
            targets = next_token_targets(carrier[5], carrier[3])
            assert int((targets != IGNORE_INDEX).sum()) == pack.loss_tokens


def heterogeneous_profile(served_steps, rounds: int = 3):
    """A model whose layers differ wildly in cost: many thin ViT blocks, few wide LLM blocks. Each layer's
    fastest of `rounds` profiles: a thin layer timed while the loaded machine ran something else would otherwise
    look as heavy as a wide one."""
    model = VLMConfig(vocab_size=1024, tile_size=112, tokens_per_tile=16, vit_dim=16, vit_layers=6, llm_dim=192,
                      llm_layers=2)
    microbatches = [microbatch(step, model, m) for step in served_steps[0][:2] for m in range(2)]
    layers = build_layers(model)
    profiles = [profile_layers(layers, layer_kinds(model), microbatches, torch.device("cpu")) for _ in range(rounds)]
    fastest = [min(timings, key=lambda p: p.time_s) for timings in zip(*profiles)]
    return model, fastest


def test_partition_search_beats_layer_count_on_a_heterogeneous_model(served_steps):
    model, profile = heterogeneous_profile(served_steps)
    decision = search_partition(profile, 2, radius=1, top_k=0)
    bounds = decision.bounds
    assert bounds[0] == 0 and bounds[-1] == model.n_layers and bounds[1] in range(1, model.n_layers)
    layer_count = evaluate(profile, split_by_weight([1.0] * len(profile), 2), 0.0)
    best = evaluate(profile, bounds, 0.0)
    # the stage times come from measured layer times: the slowest stage of the search must be clearly faster
    assert max(best.stage_s) < 0.9 * max(layer_count.stage_s)
    assert {tuple(c.bounds) for c in decision.candidates} == {tuple(b) for b in candidates_around(
        split_by_weight([p.time_s for p in profile], 2), 1, len(profile))}
    assert [b.origin for b in decision.baselines] == ["layer-count", "param-count", "anchor"]


def test_partition_search_keeps_the_fastest_measured_candidate():
    from packfeed.trainer.parallel.profile import LayerProfile

    profile = [LayerProfile("vit", 1.0, 1.0, 10, 100, 0, 0) for _ in range(6)]
    timings = {}

    def measure(bounds):
        timings[tuple(bounds)] = 1.0 if bounds == [0, 4, 6] else 2.0  # the real pipeline disagrees with the metric
        return timings[tuple(bounds)]

    decision = search_partition(profile, 2, radius=1, top_k=3, measure=measure)
    assert decision.bounds == [0, 4, 6] and len(timings) == 3


def test_split_by_weight_balances_and_never_leaves_a_stage_empty():
    assert split_by_weight([1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 6, 8]
    assert split_by_weight([10, 1, 1, 1, 1], 2) == [0, 1, 5]
    assert split_by_weight([1, 1, 1], 3) == [0, 1, 2, 3]
    heavy_last = split_by_weight([0, 0, 0, 100], 3)
    assert heavy_last[-2] == 3 and all(a < b for a, b in zip(heavy_last, heavy_last[1:]))


def test_choose_keep_spends_the_headroom_on_the_most_time():
    counts, per_block = {"vit": 4, "llm": 2}, {"vit": 10.0, "llm": 30.0}
    seconds = {"vit": 1.0, "llm": 2.0}
    assert choose_keep(counts, per_block, seconds, 65.0) == {"vit": 2, "llm": 1} or \
        choose_keep(counts, per_block, seconds, 65.0) == {"vit": 3, "llm": 1}
    keep = choose_keep(counts, per_block, seconds, 65.0)
    assert keep["vit"] * 10 + keep["llm"] * 30 <= 65
    assert choose_keep(counts, per_block, seconds, 5.0) == {"vit": 0, "llm": 0}
    assert choose_keep(counts, per_block, seconds, 1e9) == {"vit": 4, "llm": 2}


def test_adaptive_recompute_respects_its_budget_on_measured_memory(served_steps):
    """Real forward + backward of a whole-model stage, memory measured by SavedBytes, a budget between
    recompute-everything and recompute-nothing: the choice fits, and recomputes some blocks but not all."""
    model = VLMConfig(**{**SMALL_MODEL, "vit_layers": 3, "llm_layers": 3})
    layers, kinds = build_layers(model), layer_kinds(model)
    carrier = microbatch(served_steps[0][0], model)

    def peak(plan):
        stage = StageModule(layers, 0, len(layers), plan)
        with SavedBytes(list(stage.parameters())) as saved:
            (loss,) = stage(*carrier)
            loss.backward()
        stage.zero_grad(set_to_none=True)
        return saved.peak

    everything = peak([k in ("vit", "llm") for k in kinds])
    nothing = peak([False] * len(kinds))
    assert everything < nothing
    budget = (everything + nothing) // 2
    decision = adaptive_recompute(0, kinds, {"vit": 1.0, "llm": 1.0}, budget, peak)
    assert decision.fits
    assert decision.measured[max(k for k in decision.measured if k.startswith("verify"))] <= budget
    recomputed_blocks = sum(decision.layers)
    assert 0 < recomputed_blocks < sum(k in ("vit", "llm") for k in kinds)
    assert not any(again for again, kind in zip(decision.layers, kinds) if kind not in ("vit", "llm"))


def test_adaptive_recompute_backs_off_when_the_estimate_is_wrong():
    """Each kind probed alone costs 5 bytes per kept block, but keeping all four blocks together costs 40
    more: the estimate says everything fits, the verify step fails, and the chooser recomputes one block."""
    kinds = ["vision_embed", "vit", "vit", "vit", "llm", "head"]

    def trial(plan):
        kept = sum(1 for again, kind in zip(plan, kinds) if kind in ("vit", "llm") and not again)
        return 100 + 5 * kept + (40 if kept >= 4 else 0)

    decision = adaptive_recompute(0, kinds, {"vit": 1.0, "llm": 1.0}, 125, trial)
    assert decision.per_block_bytes == {"vit": 5.0, "llm": 5.0}
    assert decision.measured["verify_0"] == 160 and decision.measured["verify_1"] == 115
    assert decision.fits and sum(decision.layers) == 1


def test_a_process_without_a_gpu_of_its_own_is_told_what_to_launch(monkeypatch):
    import pytest
    from packfeed.trainer.config import load_config
    from packfeed.trainer.train import rank_device

    config = load_config(None, ["parallel.device=cuda", "parallel.pp=2"])
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))  # one process more than this node's GPUs
    with pytest.raises(ValueError, match="no GPU of its own.*parallel.pp=1"):
        rank_device(config)
    assert rank_device(load_config(None, ["parallel.device=cpu"])) == torch.device("cpu")


def test_config_is_checked_at_start_and_never_changed(tmp_path):
    """Bad choices fail when the config is loaded (not mid-run); sizing the model for the dataset makes a new
    model config, so the config the run dumps is the one the user gave."""
    import dataclasses

    import pytest
    from packfeed.trainer.config import load_config
    from packfeed.trainer.models.reference import sized_model
    from packfeed.v1 import packfeed_pb2 as pb

    for override, message in (("partition.mode=fastest", "PartitionConfig.mode"),
                              ("recompute.mode=some", "RecomputeConfig.mode"),
                              ("parallel.schedule=zb", "ParallelConfig.schedule"),
                              ("data.strategy=greedy", "strategy must be one of"),
                              ("data.cost_model=missing.json", "not found"),
                              ("parallel.schedule=interleaved_1f1b parallel.pp=1", "needs parallel.pp >= 2"),
                              ("partition.radius=4", "choose 0 to 3"),
                              ("parallel.encoder=bubbles parallel.pp=1", "no bubbles"),
                              ("parallel.encoder=bubbles parallel.data_parallel=fsdp", "ddp-style"),
                              ("parallel.encoder=bubbles parallel.schedule=interleaved_1f1b", "1f1b or gpipe"),
                              ("parallel.encoder=anywhere", "ParallelConfig.encoder"),
                              ("parallel.cp=2 parallel.pp=1 parallel.data_parallel=fsdp", "set parallel.data_parallel=ddp"),
                              ("parallel.timeout_s=0", "parallel.timeout_s"),
                              ("data.index=a.parquet data.mixture=m.yaml", "data.index or data.mixture"),
                              ("data.window=-1", "window must be >= 0"),
                              ("model.hf=qwen2_vl model.hf_attention=sdpa parallel.pp=2", "pipeline stages")):
        with pytest.raises(ValueError, match=message):
            load_config(None, override.split())
    config = load_config(None, ["data.index=x.parquet", "model.vocab_size=100"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data.target = "elsewhere:1"
    conventions = pb.ModelConventions(vocab_size=2001, image_policy=pb.ImagePolicy(
        name="internvl", tile_size=112, tokens_per_tile=16))
    sized = sized_model(config.model, conventions)
    assert (sized.tile_size, sized.tokens_per_tile, sized.vocab_size) == (112, 16, 2048)
    assert (config.model.tile_size, config.model.vocab_size) == (448, 100)
    with pytest.raises(ValueError, match="square tiles"):
        sized_model(config.model, pb.ModelConventions(image_policy=pb.ImagePolicy(name="qwen2vl")))


def test_a_model_is_named_apart_from_its_sizes():
    """model.hf names the model, model.flavor its sizes (torchtitan's name and flavor); sizes given one by one
    override the flavor's; an unknown flavor fails at load naming the ones there are. The 2B flavors have the
    parameter counts their names promise (built on the meta device: no memory)."""
    import pytest
    from packfeed.trainer.config import load_config
    from packfeed.trainer.models.reference import build_layers, sized_model
    from packfeed.v1 import packfeed_pb2 as pb

    tiny = load_config(None, []).model
    assert (tiny.flavor, tiny.llm_dim, tiny.vit_layers) == ("tiny", 128, 4)
    bigger = load_config(None, ["model.flavor=2b", "model.llm_layers=2"]).model
    assert (bigger.llm_dim, bigger.vit_dim, bigger.llm_layers) == (2048, 1024, 2)
    for override, message in (("model.flavor=huge", "the reference VLM comes in tiny, 2b"),
                              ("model.hf=llava model.flavor=2b", "llava comes in tiny")):
        with pytest.raises(ValueError, match=message):
            load_config(None, override.split())

    conventions = pb.ModelConventions(vocab_size=32000, image_policy=pb.ImagePolicy(
        name="internvl", tile_size=448, tokens_per_tile=256))
    with torch.device("meta"):
        layers = build_layers(sized_model(load_config(None, ["model.flavor=2b"]).model, conventions))
    assert 1.8e9 < sum(p.numel() for p in layers.parameters()) < 2.4e9

    pytest.importorskip("transformers")
    from packfeed.trainer.models.hf.build import build_hf_model

    qwen = load_config(None, ["model.hf=qwen2_vl", "model.flavor=2b",
                              "model.hf_config={text: {num_hidden_layers: 2}}"]).model
    assert qwen.hf_sizes["text"]["num_hidden_layers"] == 2 and qwen.hf_sizes["text"]["hidden_size"] == 1536
    policy = pb.ImagePolicy(name="qwen2vl", patch_size=14, parameters_json='{"factor": 28}')
    qwen_conventions = pb.ModelConventions(vocab_size=151_936, image_context_id=151_655, image_policy=policy)
    full = load_config(None, ["model.hf=qwen2_vl", "model.flavor=2b"]).model
    with torch.device("meta"):
        model = build_hf_model("qwen2_vl", qwen_conventions, full.hf_sizes)
    assert 2.0e9 < sum(p.numel() for p in model.parameters()) < 2.4e9  # Qwen2-VL-2B: 2.2B


def test_a_full_disk_says_so_and_keeps_the_last_checkpoint(tmp_path, small_tile_index):
    """The run's disk fills up (a 7 MiB tmpfs: one 4.6 MiB checkpoint fits, the next does not): the run fails
    saying the disk is full and which checkpoint resumes it, and leaves no incomplete checkpoint behind."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN): the full disk cannot be made")
    try:
        done = subprocess.run([sys.executable, "-m", "packfeed.cli", "train", "--nproc", "1",
                               *[f"model.{k}={v}" for k, v in SMALL_MODEL.items()], "data.microbatches=2",
                               "data.server_workers=1", "parallel.pp=1", "parallel.dp=1", "recompute.mode=none",
                               f"data.index={small_tile_index}", "optim.steps=3", "checkpoint.every=1",
                               f"out={disk / 'run'}"], capture_output=True, text=True, timeout=600)
        checkpoints = disk / "run" / "checkpoints"
        assert done.returncode != 0
        assert "the disk is full" in done.stderr and "step-000001, is kept" in done.stderr, done.stderr[-3000:]
        assert (checkpoints / "latest").read_text() == "step-000001"
        assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000001"]  # the incomplete one removed
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_the_schedule_written_to_a_full_disk_raises_no_space(tmp_path):
    """scheduler.pt is the last file of a checkpoint: written where the shards just fit, torch.save reports the
    full disk as "unexpected pos ..."; written through memory it is an ENOSPC that becomes `DiskFull`."""
    import errno
    import subprocess

    from packfeed.trainer.checkpoint import _no_space, write_torch

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN): the full disk cannot be made")
    state = {"weights": torch.zeros(64 << 10)}  # 256 KiB: four times the disk
    try:
        with pytest.raises(OSError) as through_memory:
            write_torch(state, disk / "scheduler.pt")
        assert through_memory.value.errno == errno.ENOSPC and _no_space(through_memory.value)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
