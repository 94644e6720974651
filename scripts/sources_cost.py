#!/usr/bin/env python3
"""What asking for the tokens' sources (`sources=True`, the server's `"speculative": {"sources":
true}`, which the chat page always asks for) costs a step, in-process on the real default pair.

1. End to end: the same greedy requests (the bench's chat and code prompts, a fixed draft length
   so that both runs take the same steps) with and without sources, interleaved A-B-B-A; the time
   per step is the generation's (after the prompt) over its steps.
2. The extra work alone, replayed on those requests' own tokens and steps: the labelled text
   stream (`_sources`, `TextStream.add(token, label)`, `spans()`) against the plain one, and the
   server's rendering of a chunk's report (`report.sources` + its JSON) and of the reply's figures
   (`report.last`, with the speedup's fit), once per reply.

    python scripts/sources_cost.py [--reps 4] [--max-tokens 128] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
import timeit

from localspec.bench.workloads import load
from localspec.runtime.engine import Engine, _sources
from localspec.llama.context import Detokenizer
from localspec.server import report as R
from localspec.server import schemas as S
from localspec.runtime.text import TextStream


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run(engine: Engine, messages, max_tokens: int, sources: bool):
    """(seconds per step after the prompt, the chunks) of one greedy generation."""
    chunks = list(engine.stream(messages, max_tokens=max_tokens, temperature=0.0, sources=sources))
    stats = chunks[-1].stats
    return stats.generation_time / stats.steps, chunks


def replay_cost(engine: Engine, chunks, number: int) -> tuple[float, float]:
    """Seconds per step of the text stream alone over a generation's tokens and steps: plain, labelled."""
    records = chunks[-1].stats.records
    steps, at = [], 0
    tokens = [t for c in chunks for t in c.tokens]
    for r in records:  # each step's tokens: its accepted draft tokens and the oracle's
        steps.append((tokens[at:at + r.accepted + 1], r))
        at += r.accepted + 1

    class Step:  # what _sources reads of a step's draft
        def __init__(self, source: str) -> None:
            self.source = source

    def plain() -> None:
        detok = Detokenizer(engine.oracle_model)
        text = TextStream(detok.feed, detok.flush)
        for toks, _ in steps:
            for t in toks:
                text.add(t)
            text.release()

    def labelled() -> None:
        detok = Detokenizer(engine.oracle_model)
        text = TextStream(detok.feed, detok.flush, labelled=True)
        for toks, r in steps:
            labels = _sources(Step(r.source), r.accepted, len(toks))
            for i, t in enumerate(toks):
                text.add(t, labels[i])
            text.release()
            text.spans()

    n = len(steps)
    a = min(timeit.repeat(plain, number=number, repeat=5)) / number / n
    b = min(timeit.repeat(labelled, number=number, repeat=5)) / number / n
    return a, b


def render_cost(chunks, number: int) -> tuple[float, float, float]:
    """Seconds to render one streamed chunk without and with its report, and the last chunk's figures."""
    chunk = max(chunks, key=lambda c: len(c.sources or ()))  # the step that yielded most

    def render(report) -> str:
        choice = S.ChatChunkChoice(delta=S.Delta(content=chunk.text), speculative=report)
        return S.ChatCompletionChunk(id="x", created=0, model="m", choices=[choice]).model_dump_json()

    without = min(timeit.repeat(lambda: render(None), number=number, repeat=5)) / number
    with_ = min(timeit.repeat(lambda: render(R.sources(chunk)), number=number, repeat=5)) / number
    figures = min(timeit.repeat(lambda: R.last(chunks[-1], text=False), number=20, repeat=5)) / 20
    return without, with_, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=4, help="A-B-B-A rounds per prompt.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3, help="Prompts per workload (chat, code).")
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the engine's).")
    args = parser.parse_args()

    prompts = load(["chat", "code"], max_prompts=args.prompts)
    print(f"CPU: {cpu_name()}")
    threads = {} if args.threads is None else {"n_threads": args.threads}
    with Engine.from_pair(n_ctx=2048, draft_length=args.draft_length, **threads) as engine:
        per_step = {False: [], True: []}
        ratios = []  # with / without, of the two generations of a pair run one after the other
        replays, renders = [], []
        for p in prompts:
            messages = p.request
            run(engine, messages, args.max_tokens, False)  # warm: the prompt is cached for both
            for _ in range(args.reps):
                times = {}
                for i, sources in enumerate((False, True, True, False)):
                    seconds, chunks = run(engine, messages, args.max_tokens, sources)
                    per_step[sources].append(seconds)
                    times[i] = seconds
                ratios += [times[1] / times[0], times[2] / times[3]]
            replays.append(replay_cost(engine, chunks, number=20))
            renders.append(render_cost(chunks, number=2000))
        off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        print(f"end to end, {len(per_step[True])} generations each ({len(prompts)} prompts x {args.reps} x 2, "
              f"{args.max_tokens} tokens, draft length {args.draft_length}), median time per step: "
              f"{off * 1e3:.2f} ms without sources, {on * 1e3:.2f} ms with; paired, with / without: "
              f"median {(q2 - 1) * 100:+.2f}%, quartiles {(q1 - 1) * 100:+.2f}% to {(q3 - 1) * 100:+.2f}%")
        plain = statistics.median(a for a, _ in replays)
        labelled = statistics.median(b for _, b in replays)
        extra = labelled - plain
        print(f"the text stream alone, per step: {plain * 1e6:.1f} us plain, {labelled * 1e6:.1f} us labelled: "
              f"{extra * 1e6:.1f} us more, {extra / off * 100:.3f}% of a step")
        without = statistics.median(r[0] for r in renders)
        with_ = statistics.median(r[1] for r in renders)
        figures = statistics.median(r[2] for r in renders)
        print(f"the server's chunk: {without * 1e6:.1f} us to render without the report, {with_ * 1e6:.1f} us with: "
              f"{(with_ - without) * 1e6:.1f} us more, {(with_ - without) / off * 100:.3f}% of a step; "
              f"the figures (the speedup's fit), once per reply: {figures * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
