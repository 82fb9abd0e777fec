"""Regenerate the Python code of router.proto: `python -m kiln.router.proto.generate [OUT_DIR]`.

Needs grpcio-tools (a dev dependency); the generated files are committed, so running the router
does not. The proto is compiled from the directory holding the `kiln` package, so the generated
modules import each other as `kiln.router.proto.router_pb2`. OUT_DIR (default: that directory)
receives `kiln/router/proto/router_pb2.py`, `router_pb2.pyi` and `router_pb2_grpc.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding kiln/
PROTO = "kiln/router/proto/router.proto"
GENERATED = ("router_pb2.py", "router_pb2.pyi", "router_pb2_grpc.py")


def generate(out_dir: Path = PACKAGE_ROOT) -> list[Path]:
    """Compile router.proto into out_dir; returns the generated files."""
    from grpc_tools import protoc  # dev dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_dir / Path(PROTO).parent / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_ROOT):
        print(path)
