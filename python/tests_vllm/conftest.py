import os
import sys

# Each vLLM in these tests: a small CPU KV cache, no usage reporting, and the engine in this
# process: with the engine core in a process of its own, the requests of one generate() reach it
# over a socket and may be split over two scheduler steps under load, so the batch (and with it
# the logprobs' last bits) differs from run to run; in process they always form one batch.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# vLLM's spawned workers import worker_fns (functions the tests run there) from this directory.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.dirname(os.path.abspath(__file__))] +
    [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
