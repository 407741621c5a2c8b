"""`pixels: encoded`: the server sends image files and their geometry, the client decodes and cuts them.

With Pillow (the CPU backend) the packs equal the exact path's byte for byte, a sample whose image does not
decode included: the client takes it out as the server would have, and reports it to the server. The
torchvision backend (nvJPEG on a GPU; tested here on the CPU, the same code) stays within the fast path's
bound of exact on every demo photograph.
"""

from __future__ import annotations

import io
import tarfile

import grpc
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from demo_data import PRESET_POLICIES, demo_image_files
from packfeed.client import LocalServer, PackStream
from packfeed.client.stream.decode import DecodeOptions, torch_tiles
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixels import decode_tiles, oriented_size
from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision")

TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "pixels", "tile_shapes", "tile_image",
           "image_sample", "image_token_spans")


@pytest.fixture(scope="module")
def header_checked_index(tmp_path_factory, demo_dataset):
    """The demo shards, with the first image of two samples truncated to a third, indexed trusting image
    headers: those samples count as valid, and only decoding finds them broken (on the server in exact mode,
    on the client in encoded mode)."""
    from conftest import SMALL_TILE_POLICY
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    root = tmp_path_factory.mktemp("header-checked")
    shards, truncated = [], 0
    for number, source in enumerate(demo_dataset.shards):
        shards.append(root / f"shard-{number}.tar")
        with tarfile.open(source) as tar, tarfile.open(shards[-1], "w") as out:
            for member in tar:
                data = tar.extractfile(member).read()
                if member.name.endswith(".jpg") and truncated < 2 and number == 0 and len(data) > 3000:
                    data, truncated = data[:len(data) // 3], truncated + 1
                member.size = len(data)
                out.addfile(member, io.BytesIO(data))
    assert truncated == 2
    index = root / "index.parquet"
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer), image_policy=SMALL_TILE_POLICY, verify_images="header")
    build_index([str(p) for p in shards], index, config, workers=1, progress=False)
    return index


def serve_both(tmp_path, index, decode: DecodeOptions | None = None, dp: int = 2):
    """Every step of every rank of one epoch, exact and encoded: {mode: ([Step], JobInfo)}."""
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"exact": {"index": str(index)},
                                                   "encoded": {"index": str(index), "pixels": "encoded"}}}))
    served = {}
    with LocalServer(config=config, workers=1) as server:
        for mode in ("exact", "encoded"):
            steps = []
            for rank in range(dp):
                with PackStream(server.target, job=mode, dataset=mode, rank=rank, dp=dp, microbatches=2,
                                decode=decode) as stream:
                    steps += [step for step in stream]
            info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job=mode))
            served[mode] = (steps, info)
    return served


def skipped_keys(steps) -> dict[str, str]:
    return {key: reason for step in steps for pack in step.packs for key, reason in pack.skipped}


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_encoded_packs_equal_exact_packs_and_client_skips_are_reported(tmp_path, header_checked_index, backend):
    """Pillow: the exact path's packs byte for byte. torchvision (on the CPU here): the same tokens and tiles,
    pixels within the fast path's error (at these 112 px tiles, as `pixels: fast` is tested)."""
    served = serve_both(tmp_path, header_checked_index, DecodeOptions(backend=backend, device="cpu", threads=2))
    (exact, exact_info), (encoded, encoded_info) = served["exact"], served["encoded"]
    assert (exact_info.pixels, encoded_info.pixels) == ("exact", "encoded")

    # The truncated JPEGs: skipped by the server's workers in exact mode, by the client in encoded mode.
    server_skips, client_skips = skipped_keys(exact), skipped_keys(encoded)
    assert server_skips and set(client_skips) == set(server_skips)
    assert all("undecodable image on the client" in reason for reason in client_skips.values())
    assert sorted(key for step in encoded for key, _ in step.client_skipped) == sorted(client_skips)
    # ... and reported to the server with the acknowledgements, like its own skips
    assert sorted(s.key for s in encoded_info.skipped) == sorted(s.key for s in exact_info.skipped) == sorted(server_skips)

    assert len(exact) == len(encoded)
    pixels, differences = 0, []
    for exact_step, encoded_step in zip(exact, encoded):
        assert encoded_step.step_loss_tokens == exact_step.step_loss_tokens  # planned: the same on every rank
        for a, b in zip(exact_step.packs, encoded_step.packs):
            assert (b.sample_keys, b.loss_tokens, b.empty) == (a.sample_keys, a.loss_tokens, a.empty)
            for name in TENSORS:
                if name != "pixels" or backend == "pil":
                    assert torch.equal(a.tensors[name], b.tensors[name]), name
            differences.append((a.pixels.int() - b.pixels.int()).abs().sum().item())
            assert not {"encoded", "encoded_sizes", "image_geometry"} & set(b.tensors)
            pixels += a.pixels.numel()
    assert pixels > 0
    if backend == "torchvision":
        assert 0 < sum(differences) / pixels < 3.0


@pytest.mark.parametrize("policy", PRESET_POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_torchvision_tiles_stay_within_the_fast_bound_of_exact(demo_dataset, policy):
    from torchvision.io import ImageReadMode, decode_jpeg

    policy = policy_from_dict(policy)
    errors, psnrs = [], []
    for data in demo_image_files(demo_dataset, ("jpg", "jpeg")):
        width, height = oriented_size(Image.open(io.BytesIO(data)))
        geometry = policy.geometry(width, height, 1)
        exact = decode_tiles(data, geometry)
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                            apply_exif_orientation=True)
        tiles = torch_tiles(image, geometry)
        assert [tuple(t.shape) for t in tiles] == [t.shape for t in exact]
        diff = np.concatenate([(t.numpy().astype(np.int16) - e.astype(np.int16)).ravel() for t, e in zip(tiles, exact)])
        mse = float(np.mean(diff.astype(np.float64) ** 2))
        errors.append(float(np.mean(np.abs(diff))))
        psnrs.append(10 * np.log10(255 ** 2 / mse) if mse else 99.0)
    assert len(errors) > 20
    assert np.mean(errors) < 1.0 and np.mean(psnrs) > 40


def test_hostile_skip_reports_are_refused_and_record_nothing(small_tile_index):
    """A client may report skips only with the acknowledgement of their own step, with sane keys and a bounded
    count; a refused acknowledgement records nothing, a good one is recorded with a printable reason."""
    with LocalServer(small_tile_index, workers=1) as server:
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        stub.OpenJob(pb.OpenJobRequest(job="acks", plan=pb.PlanSpec(dp=1, microbatches=1)))
        next(iter(stub.StreamPacks(pb.StreamPacksRequest(job="acks", rank=0))))

        def ack(*skipped, step=0):
            return stub.AckStep(pb.AckStepRequest(job="acks", rank=0, epoch=0, step=0, skipped=[
                pb.SkippedSample(key=key, reason=reason, epoch=0, step=step) for key, reason in skipped]))

        for bad in ([("", "no key")], [("k" * 300, "long key")], [("key", "other step")] * 2):
            with pytest.raises(grpc.RpcError) as refused:
                ack(*bad, step=1 if bad[0][1] == "other step" else 0)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as refused:
            ack(*[("key", "many")] * 5000)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.GetJob(pb.GetJobRequest(job="acks")).skipped_count == 0

        ack(("sample-x", "bad\x00 image" + "!" * 5000))
        info = stub.GetJob(pb.GetJobRequest(job="acks"))
    assert info.skipped_count == 1 and info.skipped[0].key == "sample-x"
    assert info.skipped[0].reason.startswith("bad  image") and len(info.skipped[0].reason) == 1024
    assert info.ranks[0].acked_step == 0
