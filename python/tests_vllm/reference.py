"""Reference outputs: a fresh vLLM `LLM` loaded from each model directory given (one after the
other, in this process), run on the tests' prompts; prints one line `REFERENCE {json}` mapping
each directory to [(token ids, logprobs), ...]; --one-by-one: one generate() per prompt."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(args):
    from vllm import LLM
    import test_engine as test_vllm
    one_by_one = "--one-by-one" in args
    dirs = [a for a in args if a != "--one-by-one"]
    out = {}
    for d in dirs:
        llm = LLM(model=d, **test_vllm.engine_kwargs())
        out[d] = test_vllm.run_prompts(llm, one_by_one)
        test_vllm.shutdown(llm)
    print("REFERENCE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
