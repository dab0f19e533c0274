"""refit: Python clients of refitd's daemons.

- refit.trainer.Trainer: a trainer process hands its weights to the publisher daemon (TrainerApi,
  proto/refit/v1/local.proto): CPU tensors through a memfd, CUDA tensors in place through CUDA IPC.
- refit.inference.Consumer: an inference process reads the subscriber daemon's weights in place
  (ConsumerApi), zero copy, under read leases renewed in the background: CPU tensors over its
  shared memory, or CUDA tensors over its device memory (CUDA IPC).
- refit.control.Control: either daemon's Control service (proto/refit/v1/control.proto), as
  refitctl speaks it: status, publish, export, wait_version, verify, resync; mTLS or plaintext.
- refit.local: start daemons locally (tests, examples).

Errors from the daemons (and local CUDA IPC failures) are refit.RefitError, with `.code` (the
grpc.StatusCode, None for local failures); refit.LeaseLostError and refit.RefitTimeoutError are
kinds of it.
"""
import pkgutil as _pkgutil

# The generated protobuf / gRPC stubs (refit.v1.*_pb2) live under a separate sys.path entry (the
# build tree's python/gen, or this package when installed with pip): let `refit` span both.
__path__ = _pkgutil.extend_path(__path__, __name__)

__all__ = ["trainer", "inference", "control", "Control", "RefitError", "LeaseLostError",
           "RefitTimeoutError"]

_ERRORS = ("RefitError", "LeaseLostError", "RefitTimeoutError")


def __getattr__(name):  # lazy: `import refit.v1.local_pb2` does not pull in torch
    if name in _ERRORS:
        from refit import _common
        return getattr(_common, name)
    if name == "Control":
        from refit.control import Control
        return Control
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
