"""refit: Python clients of refitd's local API (proto/refit/v1/local.proto).

- refit.trainer.Trainer: a trainer process hands its weights to the publisher daemon (TrainerApi).
- refit.inference.Consumer: an inference process reads the subscriber daemon's weights in place
  (ConsumerApi), zero copy, under read leases.

Tensor memory is shared through shared-memory objects (memfd / POSIX shm); CUDA IPC is not
supported yet (issue 4).
"""
import pkgutil as _pkgutil

# The generated protobuf / gRPC stubs (refit.v1.*_pb2) live under a separate sys.path entry (the
# build tree's python/gen, or this package when installed with pip): let `refit` span both.
__path__ = _pkgutil.extend_path(__path__, __name__)

__all__ = ["trainer", "inference", "RefitError"]


def __getattr__(name):  # lazy: `import refit.v1.local_pb2` does not pull in torch
    if name == "RefitError":
        from refit._common import RefitError
        return RefitError
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
