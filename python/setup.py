"""Generates refit/v1/*_pb2*.py from ../proto at build time (protoc + grpc_python_plugin, from
protobuf-compiler-grpc) unless they are there already; metadata is in pyproject.toml.

The source tree never holds the stubs: the CMake target `refit_python` writes them to
<build>/python/gen, and this script writes them into the build directory of the wheel. Set
REFIT_PROTO_DIR when building from a copy of python/ without ../proto next to it."""
import glob
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = self.build_lib
        proto_dir = os.environ.get("REFIT_PROTO_DIR", os.path.join(HERE, "..", "proto"))
        protos = sorted(glob.glob(os.path.join(proto_dir, "refit", "v1", "*.proto")))
        if not protos:
            raise RuntimeError(f"refit: no .proto files under {proto_dir}/refit/v1 (set REFIT_PROTO_DIR)")
        protoc = shutil.which("protoc")
        plugin = shutil.which("grpc_python_plugin")
        if not protoc or not plugin:
            raise RuntimeError("refit: building needs protoc and grpc_python_plugin on PATH "
                               "(Debian: protobuf-compiler protobuf-compiler-grpc)")
        include = os.path.join(os.path.dirname(os.path.dirname(protoc)), "include")
        os.makedirs(os.path.join(out, "refit", "v1"), exist_ok=True)
        subprocess.check_call([protoc, "-I", proto_dir, "-I", include, f"--python_out={out}",
                               f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={plugin}", *protos])
        open(os.path.join(out, "refit", "v1", "__init__.py"), "a").close()


setup(cmdclass={"build_py": BuildWithStubs})
