"""Generates the Python stubs of `tandem/engine/v1/engine.proto` with grpcio-tools (build time only).

`generate(proto_dir, out_dir)` writes `engine_pb2.py` and `engine_pb2_grpc.py` into `out_dir` (a
package: an `__init__.py` is written too) and rewrites the stub's absolute import of
`tandem.engine.v1` into a relative one, so the stubs live inside `tandem_kv` and clash with no other
top-level `tandem` package. Raises `RuntimeError` when protoc fails or the proto is missing.
"""

import os
import shutil
import tempfile

PROTO = "tandem/engine/v1/engine.proto"


def generate(proto_dir: str, out_dir: str) -> None:
    """Compiles `<proto_dir>/tandem/engine/v1/engine.proto` into `out_dir`."""
    from grpc_tools import protoc  # build-time dependency
    import grpc_tools

    src = os.path.join(proto_dir, PROTO)
    if not os.path.isfile(src):
        raise RuntimeError(f"engine.proto not found at {src} (set TANDEM_PROTO_DIR)")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_dir}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--grpc_python_out={tmp}",
                src,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {src} (exit {rc})")
        gen = os.path.join(tmp, "tandem", "engine", "v1")
        os.makedirs(out_dir, exist_ok=True)
        for name in ("engine_pb2.py", "engine_pb2_grpc.py"):
            with open(os.path.join(gen, name)) as f:
                text = f.read()
            text = text.replace("from tandem.engine.v1 import engine_pb2", "from . import engine_pb2")
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(text)
        with open(os.path.join(out_dir, "__init__.py"), "w") as f:
            f.write('"""Generated from tandem/engine/v1/engine.proto at build time; do not edit."""\n')
    shutil.rmtree(os.path.join(out_dir, "__pycache__"), ignore_errors=True)
