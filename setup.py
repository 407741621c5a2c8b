"""Build step: generate the gRPC/protobuf Python modules from protos/ (package `packfeed.v1`).

Everything else about the package lives in pyproject.toml. The generated *_pb2*.py files are written next
to the .proto sources (ignored by git) at build and install time, editable installs included, and are
never edited by hand.
"""

import os
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_ROOT = ROOT / "protos"


def generate_protos() -> None:
    """Generated into a scratch folder, then each file moved into place only where it differs: several installs of
    this checkout at once (CI builds three environments side by side) never see a half-written module."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory(dir=PROTO_ROOT) as scratch:
        for proto in sorted(PROTO_ROOT.rglob("*.proto")):
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={scratch}",
                    f"--pyi_out={scratch}", f"--grpc_python_out={scratch}", str(proto)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
        for made in Path(scratch).rglob("*_pb2*"):
            target = PROTO_ROOT / made.relative_to(scratch)
            if not target.exists() or target.read_bytes() != made.read_bytes():
                os.replace(made, target)


class BuildWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
