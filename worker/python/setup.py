"""Build hook: generates the gRPC stubs of `tandem.engine.v1` from the repo's proto at build time.

The proto is read from `$TANDEM_PROTO_DIR` or `../interfaces/proto` (this package lives in
`worker/python`); the stubs land in the built package as `tandem_kv/_pb/engine_pb2{,_grpc}.py`, so
messages added to engine.proto appear without a change here. Nothing generated is committed.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        import importlib.util

        # Loaded by path: importing the package would need the stubs this generates.
        spec = importlib.util.spec_from_file_location("_tandem_codegen", os.path.join(HERE, "src", "tandem_kv", "_codegen.py"))
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)

        proto_dir = os.environ.get("TANDEM_PROTO_DIR") or os.path.join(HERE, "..", "interfaces", "proto")
        codegen.generate(proto_dir, os.path.join(self.build_lib, "tandem_kv", "_pb"))


setup(cmdclass={"build_py": BuildWithStubs})
