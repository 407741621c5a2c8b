"""A client in another language, written only from the proto and protos/README.md (Node with @grpc/grpc-js,
tests/node_client/client.js), receives exactly the packs `PackStream` does: same keys, same tensor bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from packfeed.client import LocalServer, PackStream

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "node_client"


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The Node client with its packages (npm installs them from the lock file on first use)."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are needed for the non-Python client (apt-get install nodejs npm)")
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=CLIENT,
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            pytest.skip(f"npm could not install the Node client's packages: {done.stderr[-500:]}")
    return CLIENT / "client.js"


def test_a_node_client_gets_the_same_packs_byte_for_byte(node_client, small_tile_index):
    proto = ROOT / "protos" / "packfeed" / "v1" / "packfeed.proto"
    with LocalServer(small_tile_index, workers=1, env={"PACKFEED_PACK_PART_KB": "64"}) as server:
        for rank in range(2):
            done = subprocess.run(["node", str(node_client), server.target, str(proto), "node-job", str(rank), "2",
                                   "2"], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            from_node = [json.loads(line) for line in done.stdout.splitlines()]
            with PackStream(server.target, job="node-job", rank=rank, dp=2, microbatches=2) as stream:
                from_python = [pack for step in stream for pack in step.packs]
            assert len(from_node) == len(from_python) > 0
            for node, python in zip(from_node, from_python):
                assert (node["step"], node["microbatch"], node["sample_keys"]) == \
                    (python.step, python.microbatch, python.sample_keys)
                assert node["step_loss_tokens"] == python.step_loss_tokens
                assert set(node["tensors"]) == set(python.tensors)
                for name, tensor in python.tensors.items():
                    assert node["tensors"][name]["shape"] == list(tensor.shape), name
                    assert node["tensors"][name]["sha256"] == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
