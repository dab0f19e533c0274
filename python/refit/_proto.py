"""Imports of the generated stubs, with an error that says how to get them."""
try:
    from refit.v1 import common_pb2, local_pb2, local_pb2_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "refit: the generated protobuf stubs (refit.v1.local_pb2, local_pb2_grpc) are missing: "
        "build the CMake target `refit_python` and put <build>/python/gen on PYTHONPATH, or "
        f"install with `pip install ./python` (needs protoc and grpc_python_plugin): {e}") from e
