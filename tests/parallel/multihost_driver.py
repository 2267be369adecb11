"""One process of a distributed job on localhost, for tests/parallel/test_multihost.py:

    python -m tests.parallel.multihost_driver '<json>'

The JSON holds ``options`` (EngineArgs fields, with the process's ``process_id``) and, for
process 0, a ``mode``: ``generate`` (greedy tokens of ``prompts``, then one prompt with n = 2,
printed as one JSON line, then a clean exit), ``loop`` (print READY, then generate forever) or
``idle`` (print READY, then wait forever). Other processes run the worker loop. The caller sets
XLA_FLAGS (devices per process)."""
import json
import logging
import sys
import time


def main() -> int:
    config = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(levelname)s %(name)s: %(message)s")
    from jaxengine.engine_args import EngineArgs
    from jaxengine.parallel import multihost

    args = EngineArgs(**config["options"])
    if multihost.initialize(args).is_worker:
        from jaxengine.multihost_worker import run_worker

        return run_worker(args)
    from jaxengine.llm import LLM
    from jaxengine.sampling_params import SamplingParams

    llm = LLM.from_engine_args(args, progress=False)
    params = SamplingParams(temperature=0, max_tokens=config.get("max_tokens", 10), ignore_eos=True)
    mode = config["mode"]
    if mode == "generate":
        print(json.dumps(generate(llm, config["prompts"], params)), flush=True)
        return 0
    print("READY", flush=True)
    while mode == "loop":
        llm.generate(config["prompts"], params, use_tqdm=False)
    while True:
        time.sleep(1)


def generate(llm, prompts, params) -> dict:
    """Greedy tokens, n = 2 samples of one prompt (block copies), preemptions, block copies and
    compilations after start-up."""
    import dataclasses

    from jaxengine.parallel import multihost

    copies = 0
    dispatch = llm.runner.dispatch

    def counting(out):
        nonlocal copies
        copies += len(out.blocks_to_copy)
        return dispatch(out)

    llm.runner.dispatch = counting
    llm.engine.traces = []
    compilations = multihost.num_compilations()
    with llm.runner.forbid_compiles():
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        forked = llm.generate(prompts[2], dataclasses.replace(params, n=2), use_tqdm=False)[0]
    kv = llm.engine.scheduler.kv
    return {"tokens": tokens, "forked": [c.token_ids for c in forked.outputs],
            "preemptions": sum(t.num_preemptions for t in llm.engine.traces), "copies": copies,
            "compilations": multihost.num_compilations() - compilations,
            "leaked_blocks": kv.num_usable_blocks - kv.num_free_blocks,
            "mesh_devices": int(llm.mesh.size), "num_cpu_blocks": llm.config.cache.num_cpu_blocks}


if __name__ == "__main__":
    sys.exit(main())
