"""Context-parallel shares over real gRPC: `PackStream(..., cp_rank=r)` gives each GPU of a rank's CP group its
share of every pack, and the shares of a pack put every token of every sample on exactly one GPU of its pack, at
its position in the unsplit sample, and every tile of every visual item on exactly one encoder."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from packfeed.client import LocalServer, PackfeedError, PackStream
from packfeed.v1.context_parallel import pack_shares, rank_chunks

C = 4


def samples_of(steps: dict) -> dict[str, dict]:
    """key -> the sample's input_ids, labels and its items' tiles (bytes), from whole packs (no CP)."""
    out = {}
    for rank_steps in steps.values():
        for step in rank_steps:
            for pack in step.packs:
                cu = pack.cu_seqlens.tolist()
                tiles = pack.tiles()
                for k, key in enumerate(pack.sample_keys):
                    items = [i for i, s in enumerate(pack.image_sample.tolist()) if s == k]
                    out[key] = {"input_ids": pack.input_ids[cu[k]:cu[k + 1]].numpy(),
                                "labels": pack.labels[cu[k]:cu[k + 1]].numpy(),
                                "items": [b"".join(tiles[t].numpy().tobytes() for t, owner in
                                                   enumerate(pack.tile_image.tolist()) if owner == i) for i in items]}
    return out


@pytest.fixture(scope="module")
def cp_streams(small_tile_index):
    """Every step of a DP 2 x CP 4 (dynamic, N = 96 tokens) job, for every (rank, cp_rank), tensors copied. Not laid
    out collective-safe: on these 40 samples that layout widens every pack (no degree 1 is left to check); the
    collective-safe layout's shares are the same wire, trained on in tests/test_cp_trainer.py."""
    got = {}
    with LocalServer(small_tile_index, workers=1) as server:
        for rank in range(2):
            for cp_rank in range(C):
                stream = PackStream(server.target, job="cp", rank=rank, cp_rank=cp_rank, dp=2, seed=0,
                                    context_parallel=C, max_tokens_per_gpu=96, collective_safe=False)
                got[rank, cp_rank] = list(stream)
                for step in got[rank, cp_rank]:
                    for pack in step.packs:
                        pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
                stream.close()
        with pytest.raises(PackfeedError, match="lane 4 is outside"):
            PackStream(server.target, job="cp", rank=0, cp_rank=C, dp=2, seed=0, context_parallel=C,
                       max_tokens_per_gpu=96, collective_safe=False)
    return got


def shares(cp_streams: dict):
    """(rank, cp_rank, step, share, (degree, cp_group, CP rank)) of every non-empty share received."""
    for (rank, cp_rank), steps in cp_streams.items():
        for step in steps:
            for pack in step.packs:
                if not pack.empty:
                    yield rank, cp_rank, step, pack, tuple(pack.cp.tolist())


def test_shares_put_every_token_on_one_gpu_at_its_unsplit_position(cp_streams, served_steps):
    reference = samples_of(served_steps)
    tokens = defaultdict(dict)  # key -> position -> (token, label)
    degrees = defaultdict(set)
    for rank, cp_rank, step, pack, (d, g, j) in shares(cp_streams):
        assert g * d + j == cp_rank and pack.cu_seqlens[-1] == len(pack.input_ids)
        lengths = np.diff(pack.cp_seqlens.numpy()).tolist()
        oversize = max(lengths) > 96 * C  # the oversize policy's (alone): over N, reported by the plan
        assert len(pack.input_ids) <= 96 or oversize, "a GPU holds more than N tokens"
        # dynamic CP spreads a pack only for a sample that needs its d GPUs, topped up with ones a GPU holds
        assert d == 1 or oversize or (lengths[0] > 96 * d // 2 and max(lengths[1:], default=0) <= 96)
        expected = [rank_chunks(chunks, j) for chunks in pack_shares(lengths, d)]
        assert pack.cp_chunks.tolist() == [[a0, b0, a1, b1] for (a0, b0), (a1, b1) in expected]
        cu = pack.cu_seqlens.tolist()
        for k, key in enumerate(pack.sample_keys):
            degrees[key].add((step.step, rank, d, g))
            for p, token, label in zip(pack.position_ids[cu[k]:cu[k + 1]].tolist(),
                                       pack.input_ids[cu[k]:cu[k + 1]].tolist(), pack.labels[cu[k]:cu[k + 1]].tolist()):
                assert p not in tokens[key], f"{key}: position {p} on two GPUs"
                tokens[key][p] = (token, label)
    assert set(tokens) == set(reference), "every sample once per epoch"
    for key, sample in reference.items():
        assert sorted(tokens[key]) == list(range(len(sample["input_ids"])))
        assert [tokens[key][p][0] for p in sorted(tokens[key])] == sample["input_ids"].tolist()
        assert [tokens[key][p][1] for p in sorted(tokens[key])] == sample["labels"].tolist()
        assert len(degrees[key]) == 1, "a sample in two packs"
    assert {d for placed in degrees.values() for _, _, d, _ in placed} >= {1, 2}, "no long sample was split"


def test_every_tile_is_encoded_once_by_the_gpu_its_piece_names(cp_streams, served_steps):
    reference = samples_of(served_steps)
    encoded = defaultdict(dict)  # (key, item number in the sample) -> first tile -> the piece's tile bytes
    split = 0
    for _, _, _, pack, (d, _, j) in shares(cp_streams):
        tiles = pack.tiles()
        owners = pack.image_sample.tolist()
        spans = pack.image_token_spans.tolist()
        pieces = pack.cp_pieces.tolist()
        for item in range(len(owners)):  # an item's pieces cover its tiles and its placeholder run once, in order
            mine = [p for p in pieces if p[0] == item]
            assert [p[1] for p in mine] == list(np.cumsum([0] + [p[2] for p in mine[:-1]]))
            assert sum(p[3] for p in mine) == spans[item][1]
            assert [p[4] for p in mine] == sorted({p[4] for p in mine}) and all(0 <= p[4] < d for p in mine)
            split += len(mine) > 1
        per_rank = [sum(p[3] for p in pieces if p[4] == r) for r in range(d)]
        assert max(per_rank) - min(per_rank) <= max((p[3] // max(p[2], 1) for p in pieces), default=0) * 2, \
            "the pack's GPUs encode unequal shares"
        for item, first, count, _, rank in pieces:
            held = [t for t, i in enumerate(pack.tile_image.tolist()) if i == item]
            if rank != j:
                continue
            assert len(held) == count, "a GPU holds tiles of an item beyond its piece"
            owner = owners[item]
            encoded[pack.sample_keys[owner], owners[:item].count(owner)][first] = \
                b"".join(tiles[t].numpy().tobytes() for t in held)
        # spans point into the unsplit samples: the placeholder run lies within its sample
        unsplit = pack.cp_seqlens.tolist()
        for (start, length), owner in zip(spans, owners):
            assert unsplit[owner] <= start and start + length <= unsplit[owner + 1]
    expected = {(key, n): data for key, sample in reference.items() for n, data in enumerate(sample["items"])}
    assert set(encoded) == set(expected)
    for item, pieces in encoded.items():
        assert b"".join(pieces[first] for first in sorted(pieces)) == expected[item], f"{item}: other tiles"
    assert split, "no item was shared out over GPUs: the pieces went untested"


def test_joined_shares_are_the_whole_packs(cp_streams, served_steps):
    from packfeed.client.model.context_parallel import whole_packs

    reference = samples_of(served_steps)
    joined = {}
    for rank in range(2):
        lanes = [cp_streams[rank, lane] for lane in range(C)]
        for steps in zip(*lanes):
            for m in range(len(steps[0].packs)):
                for pack in whole_packs([step.packs[m] for step in steps]):
                    assert "cp" not in pack.tensors
                    joined.update(samples_of({0: [type(steps[0])(0, 0, rank, [pack])]}))
    assert joined.keys() == reference.keys()
    for key, sample in reference.items():
        assert np.array_equal(joined[key]["input_ids"], sample["input_ids"])
        assert np.array_equal(joined[key]["labels"], sample["labels"])
        assert joined[key]["items"] == sample["items"]


def test_hugging_face_inputs_refuse_a_share_and_take_the_joined_pack(cp_streams):
    from packfeed.client.model.context_parallel import whole_packs
    from packfeed.client.model.hf import to_hf_inputs

    lanes = [cp_streams[0, lane][0].packs[0] for lane in range(C)]
    share = next(p for p in lanes if not p.empty)
    with pytest.raises(ValueError, match="context-parallel share"):
        to_hf_inputs(share, "internvl")
    inputs = to_hf_inputs(whole_packs(lanes)[0], "internvl")
    assert inputs["input_ids"].shape[-1] == int(whole_packs(lanes)[0].cu_seqlens[-1])


@pytest.mark.parametrize("layout", ["every sample at degree 4", "degrees 2, 1 and 1 side by side"])
def test_a_share_gives_the_unsplit_mrope_positions_of_its_tokens(tmp_path, layout):
    """Qwen2.5-VL images and videos: each GPU's M-RoPE rows (computed from its share alone, over the wire
    encoding) equal the whole pack's at the same tokens, also for image tokens whose pixels another GPU holds."""
    pytest.importorskip("transformers")
    pytest.importorskip("av")
    from test_hf_video import GROUPS, built_packs, video_family

    from packfeed.client.model.context_parallel import share_mrope_positions, unsplit_rows
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.serve.cp_shares import cp_shares
    from packfeed.server.serve.wire import encode_pack

    data = video_family(tmp_path, "qwen2_5_vl")
    pack = built_packs(data, [GROUPS[0] + GROUPS[1]])[0]
    whole = pack_of(encode_pack(pack, 1, False))
    expected = to_hf_inputs(whole, "qwen2_5_vl", conventions=data.conventions)["position_ids"][1:, 0]  # (3, L)
    assert torch.equal(share_mrope_positions(whole, "qwen2_5_vl"), expected)  # a whole pack gives its own
    n = len(whole.sample_keys)
    if layout == "every sample at degree 4":
        degree, group = np.full(n, 4), np.zeros(n, np.int64)
    else:
        degree = np.array([2] * (n // 2) + [1] * (n - n // 2))
        group = np.array([0] * (n // 2) + [2] * (n // 4) + [3] * (n - n // 2 - n // 4))
    checked, foreign = 0, 0
    temporal = data.conventions.image_policy.temporal_patch_size
    for share in (pack_of(encode_pack(s, 1, False)) for s in cp_shares(pack, degree, group, 4, temporal)):
        if share.empty or not len(share.input_ids):
            continue
        got = share_mrope_positions(share, "qwen2_5_vl")
        rows = unsplit_rows(share)
        bounds = share.cp_seqlens.long()
        sample = torch.searchsorted(bounds, rows, right=True) - 1
        whole_start = whole.cu_seqlens.long()[[whole.sample_keys.index(k) for k in share.sample_keys]]
        assert torch.equal(got, expected[:, whole_start[sample] + rows - bounds[sample]])
        checked += len(rows)
        j = int(share.cp[2])
        pieces = share.cp_pieces.tolist()
        for item, (start, length) in enumerate(share.image_token_spans.tolist()):
            elsewhere = any(p[0] == item and p[4] != j for p in pieces)
            foreign += int(elsewhere and bool(((rows >= start) & (rows < start + length)).any()))
    assert checked == len(whole.input_ids), "every token's positions checked once"
    assert foreign, "no GPU held tokens of an item another GPU encodes: the geometry went untested"


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_pieces_share_out_a_long_video_in_whole_temporal_patches(ranks):
    """A 131-frame video (temporal patches of 2 frames, 4 tokens each) beside tiled and Qwen-style images: each
    GPU encodes within one unit of its share of the placeholder tokens, a video is cut only between temporal
    patches, an item whose tokens its units do not divide stays whole, and every tile is in exactly one piece."""
    from packfeed.server.serve.cp_shares import encoder_pieces
    from packfeed.v1.options import VisualKind

    tiles = np.array([131, 6, 1, 3, 1])
    tokens = np.array([66 * 4, 6 * 16, 40, 10, 24])  # the 3-tile image's 10 tokens do not divide into 3 units
    kinds = np.array([VisualKind.VIDEO, VisualKind.IMAGE, VisualKind.IMAGE, VisualKind.IMAGE, VisualKind.VIDEO])
    pieces = encoder_pieces(tiles, tokens, kinds, ranks, temporal_patch=2)
    assert np.array_equal(pieces, encoder_pieces(tiles, tokens, kinds, ranks, temporal_patch=2))
    for item in range(len(tiles)):
        mine = pieces[pieces[:, 0] == item]
        assert mine[0, 1] == 0 and np.array_equal(mine[1:, 1], np.cumsum(mine[:-1, 2]))
        assert mine[:, 2].sum() == tiles[item] and mine[:, 3].sum() == tokens[item]
        assert np.all(np.diff(mine[:, 4]) > 0)
        if kinds[item] == VisualKind.VIDEO:
            assert np.all(mine[:, 1] % 2 == 0), "a temporal patch was cut"
    assert len(pieces[pieces[:, 0] == 3]) == 1 and len(pieces[pieces[:, 0] == 2]) == 1
    per_rank = np.bincount(pieces[:, 4], weights=pieces[:, 3], minlength=ranks)
    assert len(per_rank) == ranks and np.all(np.abs(per_rank - tokens.sum() / ranks) <= 40), per_rank
    # the video holds 61% of the tokens: every GPU whose share starts within it encodes a piece of it
    video_ranks = pieces[pieces[:, 0] == 0, 4].tolist()
    assert video_ranks == [r for r in range(ranks) if r * tokens.sum() / ranks < tokens[0] - 2], video_ranks
