"""Run by tests/test_rpc.py in a subprocess whose PYTHONPATH puts the RPC-enabled llama_cpp first:
the default pair's oracle loaded locally, then split over rpc-servers, greedy, with and without
drafting; prints one JSON object. Arguments: one JSON object (oracle, draft, servers, prompts,
max_tokens)."""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np


def main() -> None:
    args = json.loads(sys.argv[1])
    import llama_cpp

    from localspec.runtime.engine import Engine
    from localspec.llama.context import local_gpus

    out: dict = {"supports_rpc": bool(llama_cpp.llama_supports_rpc()), "llama_cpp": llama_cpp.__file__,
                 "local_gpus": [d.name for d in local_gpus()],
                 # llama_supports_gpu_offload() says yes in an RPC build, even on a CPU-only machine
                 "supports_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}

    # llama.cpp's own account of where the weights went (its load log, routed to Python logging)
    log_lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log_lines.append(record.getMessage())

    llama_log = logging.getLogger("localspec.llama.context")
    llama_log.setLevel(logging.DEBUG)
    llama_log.addHandler(Collect())
    llama_log.propagate = False

    servers, prompts, max_tokens = args["servers"], args["prompts"], args["max_tokens"]
    messages = [[{"role": "user", "content": p}] for p in prompts]

    def run(engine: Engine, **kw) -> dict:
        steps: list[tuple[list[int], list[int]]] = []
        original = engine.stepper.accept

        def recording(tokens, probs, logits, sampling, rng, *, picked=None, **kw):
            emitted, n_accepted = original(tokens, probs, logits, sampling, rng, picked=picked, **kw)
            argmax = logits.argmax(axis=1) if picked is None else picked  # picked: by llama.cpp, in its graph
            steps.append((argmax[:len(emitted)].tolist(), emitted.tolist()))
            return emitted, n_accepted

        engine.stepper.accept = recording
        t0 = time.perf_counter()
        try:
            results = [engine.generate(m, max_tokens=max_tokens, **kw) for m in messages]
        finally:
            engine.stepper.accept = original
        timings.append(round(time.perf_counter() - t0, 2))
        return {"tokens": [r.tokens for r in results], "text": [r.text for r in results],
                "drafted": sum(r.stats.drafted for r in results), "accepted": sum(r.stats.accepted for r in results),
                "steps": steps}

    def logits_of(engine: Engine, tokens: list[int]) -> np.ndarray:
        engine.oracle.reset()
        engine.oracle.sample_greedy(0, False)  # its rows' logits, not the greedy picks its requests took
        return np.array(engine.oracle.decode(tokens, n_logits=len(tokens)))

    timings: list[float] = []  # seconds per run, for the test's log
    out["timings"] = timings
    common = dict(n_ctx=1024, draft_length=4, cost_cache=False, lookup=False)  # the draft model alone
    with Engine(args["oracle"], None, **common) as local:
        out["local"] = run(local)
        sequence = local.tokenize_prompt(messages[0]) + out["local"]["tokens"][0]
        local_logits = logits_of(local, sequence)

    log_lines.clear()
    progress: list[str] = []
    with Engine(args["oracle"], args["draft"], rpc=servers, progress=progress.append, **common) as split:
        placement = split.oracle_model.placement
        out["placement"] = {"layers": placement.layers, "n_gpu_layers": placement.n_gpu_layers,
                            "n_layer": placement.n_layer, "devices": [d.description for d in placement.devices]}
        out["draft_devices"] = getattr(split.draft_model, "placement", None) is not None
        out["load_log"] = [line for line in log_lines if "buffer size" in line or "offloaded" in line]
        out["progress"] = progress
        out["flash_attn"] = split.oracle.flash_attn
        out["rpc_plain"] = run(split, speculative=False)
        out["rpc_spec"] = run(split)
        out["split_copies_cache"] = split.proposer.cache_source is not None
        out["logit_max_abs_diff"] = float(np.abs(logits_of(split, sequence) - local_logits).max())

    with Engine(args["oracle"], args["draft"], draft_rpc=servers[-1:], **common) as remote_draft:
        out["draft_placement"] = remote_draft.draft_model.placement.layers
        out["oracle_local"] = getattr(remote_draft.oracle_model, "placement", None) is None
        out["draft_rpc_spec"] = run(remote_draft)
        out["remote_draft_copies_cache"] = remote_draft.proposer.cache_source is not None
    # --gpu-layers N with RPC: exactly the last N layers (the output layer among them) leave this machine
    with Engine(args["draft"], None, rpc=servers, gpu_layers=5, **common) as five:
        out["five_layers"] = five.oracle_model.placement.layers
    print(json.dumps(out))


if __name__ == "__main__":
    main()
