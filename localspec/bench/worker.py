"""One bench system in its own process: load once, then run prompts on request.

Each system runs in its own process so that its peak RSS is its own, and so that llama.cpp state
(log callbacks, thread pools, caches) cannot leak between systems. The parent speaks JSON lines over
the worker's stdin and a private copy of its stdout (fd 1 itself is pointed at stderr, so nothing
llama.cpp prints can corrupt the protocol):

    {"op": "load", "system": {...}, "models": {...}, "n_ctx": 4096, "threads": 2}  -> {"ok": true, "info": {...}}
    {"op": "prepare", "prompts": [...]}       -> rendered text and tokens of each prompt (load a baseline first)
    {"op": "run", "tokens": [...], "max_tokens": N, "speculative": true}
                                               -> tokens, text, stats, chunk arrival times, the engine's
                                                  per-step records (speculative false: the same engine,
                                                  drafting off)
    {"op": "rss"}                              -> peak RSS of this process
    {"op": "quit"}

Run as ``python -m localspec.bench.worker``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections import Counter
from typing import Any

RECORD_FIELDS = ("k", "drafted", "accepted", "draft_time", "verify_time", "context", "draft_evaluated",
                 "draft_prompt_time", "source")


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


# ------------------------------------------------------------------------------------ localspec


class LocalspecRunner:
    def __init__(self, system: dict, models: dict, n_ctx: int, threads: int) -> None:
        from localspec.runtime.engine import Engine

        params = system["params"]
        draft = params.get("draft")
        kwargs: dict[str, Any] = {"n_ctx": n_ctx, "n_threads": threads}
        if draft is None:
            draft_arg = None
        else:
            draft_arg = models["draft"] if draft == "model" else "ngram"
            kwargs["draft_length"] = params.get("draft_length")
            kwargs["lookup"] = bool(params.get("lookup"))
            if draft == "model" and models.get("cross_tokenizer"):
                kwargs["cross_tokenizer"] = True
        if params.get("flash_attn"):
            kwargs["flash_attn"] = params["flash_attn"]
        if params.get("suffix_cache"):  # off unless the system asks: repetitions would draft from earlier ones
            kwargs["suffix_cache"] = params["suffix_cache"]
        self.kwargs = dict(kwargs)
        t0 = time.perf_counter()
        self.engine = Engine(models["oracle"], draft_arg, **kwargs)
        self.load_time = time.perf_counter() - t0
        self.system = system

    def info(self) -> dict:
        e = self.engine
        return {"load_time": self.load_time, "engine_kwargs": self.kwargs, "policy": type(e.policy).__name__,
                "proposer": type(e.proposer).__name__ if e.proposer is not None else None,
                "n_ctx": e.n_ctx}

    def prepare(self, prompts: list[dict]) -> list[dict]:
        """Render and tokenize each prompt exactly as Engine.stream does; also the text to hand a
        C++ program that tokenizes with add_special=True, parse_special=True."""
        e = self.engine
        m = e.oracle_model
        bos_text = m.token_piece(m.bos, special=True).decode(errors="replace") if m.bos >= 0 else ""
        out = []
        for p in prompts:
            request = p.get("messages") or p.get("prompt")
            tokens = e.tokenize_prompt(request)
            text = e.render(request) if p.get("messages") else request
            # The C++ programs tokenize their prompt with add_special=True, parse_special=True: find
            # the text that gives them the same tokens (without a BOS the template already wrote).
            candidates = [text] + ([text[len(bos_text):]] if bos_text and text.startswith(bos_text) else [])
            anchor_text, match = text, False
            for c in candidates:
                if m.tokenize(c, add_special=True, parse_special=True) == tokens:
                    anchor_text, match = c, True
                    break
            echo = b"".join(m.token_piece(t, special=True) for t in tokens).decode("utf-8", errors="replace")
            out.append({"id": p["id"], "text": text, "anchor_text": anchor_text, "tokens": tokens,
                        "anchor_tokens_match": match, "echo": echo})
        return out

    def run(self, tokens: list[int], max_tokens: int, speculative: bool = True, json_schema: dict | None = None,
            temperature: float = 0.0) -> dict:
        from localspec.constraints import Constraint
        from localspec.runtime.sequence import Request
        from localspec.speculative.sampling import SamplingParams

        for ctx in self.engine.contexts:  # every run evaluates its whole prompt: no prefix reuse between runs
            ctx.reset()
        request = Request(max_tokens=max_tokens, speculative=speculative, sampling=SamplingParams(temperature=temperature),
                          constraint=Constraint.json_schema(json_schema) if json_schema is not None else None)
        t_start = time.perf_counter()
        chunks: list[tuple[float, int]] = []
        out_tokens: list[int] = []
        text: list[str] = []
        final = None
        for final in self.engine.stream_tokens(list(tokens), request):
            chunks.append((time.perf_counter() - t_start, len(final.tokens)))
            out_tokens.extend(final.tokens)
            text.append(final.text)
        assert final is not None and final.stats is not None
        s = final.stats
        return {"tokens": out_tokens, "text": "".join(text), "finish_reason": final.finish_reason,
                "stats": s.to_dict(), "chunks": chunks,
                "decode_time": s.generation_time, "completion_tokens": s.completion_tokens,
                "tokens_per_second": s.tokens_per_second, "ttft": s.time_to_first_token,
                "drafted": s.drafted, "accepted": s.accepted, "steps": s.steps,
                "draft_lengths": {str(k): n for k, n in sorted(Counter(r.drafted for r in s.records).items())},
                "records": [[getattr(r, f) for f in RECORD_FIELDS] for r in s.records]}

    def close(self) -> None:
        self.engine.close()


# ------------------------------------------------------------------------ llama-cpp-python lookup


class CountingDraft:
    """Wraps a llama-cpp-python draft model and records every draft (history length, tokens)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.calls.append((len(input_ids), [int(t) for t in out]))  # called once after every oracle pass
        return out


class LlamaCppPythonRunner:
    def __init__(self, system: dict, models: dict, n_ctx: int, threads: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        params = system["params"]
        k = params.get("num_pred_tokens") or (10 if llama_cpp.llama_supports_gpu_offload() else 2)
        self.num_pred_tokens = k
        self.draft = CountingDraft(LlamaPromptLookupDecoding(max_ngram_size=params.get("max_ngram_size", 2),
                                                              num_pred_tokens=k))
        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(models["oracle_path"]), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=-1,
                                   draft_model=self.draft, verbose=False)
        self.load_time = time.perf_counter() - t0
        self.llama_cpp = llama_cpp

    def info(self) -> dict:
        return {"load_time": self.load_time, "num_pred_tokens": self.num_pred_tokens,
                "llama_cpp_python": self.llama_cpp.__version__}

    def run(self, tokens: list[int], max_tokens: int, speculative: bool = True, json_schema: dict | None = None,
            temperature: float = 0.0) -> dict:
        if not speculative:
            raise ValueError("llama-cpp-python's prompt lookup cannot be switched off per run")
        if temperature:
            raise ValueError("llama-cpp-python's runs are greedy")
        llm, lc = self.llm, self.llama_cpp
        vocab = lc.llama_model_get_vocab(llm.model)
        llm.reset()
        self.draft.calls.clear()
        out: list[int] = []
        arrivals: list[tuple[float, int]] = []  # (time, oracle pass the token came from)
        t_start = time.perf_counter()
        finish = "length"
        for token in llm.generate(list(tokens), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            now = time.perf_counter() - t_start
            if lc.llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            out.append(int(token))
            arrivals.append((now, len(self.draft.calls)))
            if len(out) >= max_tokens:
                break
        t_end = time.perf_counter() - t_start
        # It yields the tokens of one oracle pass one by one, microseconds apart: group them into
        # chunks per pass (as localspec's are), timed at the first token of the pass.
        chunks: list[tuple[float, int]] = []
        last_pass = None
        for now, n_pass in arrivals:
            if n_pass == last_pass:
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + 1)
            else:
                chunks.append((now, 1))
                last_pass = n_pass
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        # Acceptance, from the drafts it made: greedy output is known, so a draft made after h tokens
        # of history was accepted for as long as it agrees with what was emitted after them.
        full = list(tokens) + out
        drafted = accepted = 0
        for h, draft in self.draft.calls:
            drafted += len(draft)
            for i, t in enumerate(draft):
                if h + i < len(full) and full[h + i] == t:
                    accepted += 1
                else:
                    break
        ttft = arrivals[0][0] if arrivals else t_end
        n = len(out)
        decode_time = (arrivals[-1][0] - arrivals[0][0]) if n > 1 else 0.0
        lengths = Counter(len(d) for _, d in self.draft.calls)
        return {"tokens": out, "text": text, "finish_reason": finish, "chunks": chunks,
                "decode_time": decode_time, "completion_tokens": n,
                "tokens_per_second": (n - 1) / decode_time if decode_time > 0 else 0.0,
                "ttft": ttft, "drafted": drafted, "accepted": accepted, "steps": len(self.draft.calls),
                "draft_lengths": {str(k): c for k, c in sorted(lengths.items())},
                "stats": {"note": "tokens/s = (n-1) / (last token - first token): prompt evaluation excluded"}}

    def close(self) -> None:
        self.llm.close()


# ------------------------------------------------------------------------------------ main loop


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # anything printed (by llama.cpp or Python) goes to stderr
    sys.stdout = sys.stderr
    runner = None

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg["op"]
            if op == "load":
                cls = LlamaCppPythonRunner if msg["system"]["kind"] == "llama-cpp-python" else LocalspecRunner
                runner = cls(msg["system"], msg["models"], msg["n_ctx"], msg["threads"])
                reply({"ok": True, "info": runner.info()})
            elif op == "prepare":
                reply({"ok": True, "prompts": runner.prepare(msg["prompts"])})
            elif op == "run":
                reply({"ok": True, "result": runner.run(msg["tokens"], msg["max_tokens"], msg.get("speculative", True),
                                                        msg.get("json_schema"), msg.get("temperature", 0.0))})
            elif op == "rss":
                reply({"ok": True, "peak_rss": peak_rss_bytes()})
            elif op == "quit":
                reply({"ok": True})
                break
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as e:  # report, keep serving: the parent decides
            reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    if runner is not None:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
