"""refitd as a vLLM weight-transfer backend: a vLLM engine takes each version that the local refitd
subscriber verified, never from the trainer, and proves what it serves.

    # every vLLM process registers the backend through the `vllm.general_plugins` entry point of
    # this package (pip install ./python), so selecting it is one line:
    llm = LLM(model=model_dir, weight_transfer_config={"backend": "refitd"})
    llm.init_weight_transfer_engine(
        {"init_info": {"socket": "/run/refitd/subscriber-local.sock", "consumer": "vllm-0"}})
    follower = refit.vllm.Follower(llm, "/run/refitd/subscriber-local.sock")
    version = follower.update()          # the newest verified version, or follower.update(12)

- `refit.vllm.engine.RefitWeightTransferEngine`: the worker side (init_info: the subscriber's
  local socket, the consumer name, the apply mode and verification; update_info: a version).
- `refit.vllm.follow`: drivers for an `LLM` in this process (`Follower`) and for a vLLM HTTP
  server started with VLLM_SERVER_DEV_MODE=1 (`HttpFollower`).
"""
from __future__ import annotations

BACKEND = "refitd"


def register() -> None:
    """The `vllm.general_plugins` entry point: registers the `refitd` backend with vLLM's
    WeightTransferEngineFactory in this process (lazily: nothing heavy is imported until vLLM
    creates the engine). Safe to call more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "refit.vllm.engine",
                                                "RefitWeightTransferEngine")


def __getattr__(name):
    if name in ("Follower", "HttpFollower", "UpdateResult"):
        from refit.vllm import follow
        return getattr(follow, name)
    raise AttributeError(f"module 'refit.vllm' has no attribute {name!r}")
