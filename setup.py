"""Build step: generate the gRPC/protobuf Python modules from protos/ (package `packfeed.v1`).

Everything else about the package lives in pyproject.toml. The generated *_pb2*.py files are written next
to the .proto sources (ignored by git) at build and install time, editable installs included, and are
never edited by hand.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_ROOT = ROOT / "protos"


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in sorted(PROTO_ROOT.rglob("*.proto")):
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={PROTO_ROOT}",
                f"--pyi_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
