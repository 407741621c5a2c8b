"""A policy's weights by version (`packfeed.client.rollouts.weights`): what the trainer publishes a rollout process
loads back bit for bit (and places where an engine reads it), in a local folder and in a real S3-protocol server (moto's, its own process on 127.0.0.1);
the newest is named only once its file is whole; old versions are pruned; waiting for an unpublished version ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from packfeed.client.rollouts.weights import LATEST, WeightVersions


def tiny() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def check_round_trip(versions: WeightVersions, placed: Path) -> None:
    net = tiny()
    assert versions.newest() is None
    with pytest.raises(FileNotFoundError, match="no weights of version None"):
        versions.load()
    published = {}
    for version in range(4):
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.add_(0.5)
        versions.publish(net.state_dict(), version)
        published[version] = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    newest, state = versions.load()
    assert newest == 3 and set(state) == set(net.state_dict())
    assert all(torch.equal(state[name], tensor) for name, tensor in net.state_dict().items())  # bit for bit
    fresh = tiny()
    fresh.load_state_dict(state)  # the tied embedding too
    ids = torch.arange(8)[None]
    assert torch.equal(fresh(ids).logits, net(ids).logits)
    with pytest.raises(FileNotFoundError, match="the newest 3 are kept"):
        versions.load(0)  # pruned
    assert versions.load(1)[0] == 1
    # a version's file where an engine reads it from its own disk (a vLLM server): the published bytes
    versions.place(3, placed / "v3" / "model.safetensors")
    assert all(torch.equal(load_file(placed / "v3" / "model.safetensors")[name], tensor)
               for name, tensor in net.state_dict().items())
    with pytest.raises(FileNotFoundError, match="the newest 3 are kept"):
        versions.place(0, placed / "v0" / "model.safetensors")
    versions.wait_published(3, timeout_s=1)
    waited = versions.wait_for(2, timeout_s=1)
    assert all(torch.equal(waited[name], tensor) for name, tensor in published[2].items())
    with pytest.raises(TimeoutError, match="version 9 was not published"):
        versions.wait_for(9, timeout_s=0.3, poll_s=0.1)


def test_weights_by_version_in_a_folder(tmp_path):
    versions = WeightVersions(tmp_path / "weights")
    check_round_trip(versions, tmp_path / "engine")
    assert (tmp_path / "engine" / "v3" / "model.safetensors").stat().st_ino == \
        (tmp_path / "weights" / "v0000000003.safetensors").stat().st_ino  # linked, not copied
    names = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert names == [LATEST, "v0000000001.safetensors", "v0000000002.safetensors", "v0000000003.safetensors"]
    with pytest.raises(ValueError, match=">= 0"):
        versions.publish(tiny().state_dict(), -1)


def test_weights_by_version_in_an_object_store(tmp_path):
    pytest.importorskip("moto")
    import s3fs
    from s3_server import S3Server, running

    with running(S3Server()) as server:
        s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True).mkdir("weights")
        check_round_trip(WeightVersions("s3://weights/run-1"), tmp_path)
