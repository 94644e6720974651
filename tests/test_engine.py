"""The engine on real models: the default SmolLM2 pair (F32 oracle, Q4_1 draft)."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.runtime.engine import Engine, PromptTooLongError
from localspec.llama.context import LlamaContext

pytestmark = pytest.mark.model

PROMPTS = [
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain in two sentences why the sky is blue.",
    "What is the capital of France? Answer in one sentence.",
    "Write a short Python function that reverses a string.",
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class VerifyRecorder:
    """Wraps the engine's acceptance rule (`Step.accept`) to record, for every step, the oracle's argmax at each verified
    position and what the step emitted."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.steps: list[tuple[np.ndarray, np.ndarray, int]] = []
        original = engine.stepper.accept

        def recording(tokens, probs, logits, sampling, rng, *, picked=None, **kw):
            out, n_accepted = original(tokens, probs, logits, sampling, rng, picked=picked, **kw)
            # the oracle's argmax: from its logits, or as llama.cpp picked it on the backend (whose
            # equality with the logits' argmax test_llama.py checks row by row)
            argmax = logits.argmax(axis=1) if picked is None else picked
            self.steps.append((argmax.copy(), out.copy(), n_accepted))
            return out, n_accepted

        monkeypatch.setattr(engine.stepper, "accept", recording)


def test_every_greedy_token_is_the_oracles_argmax_at_its_verified_position(engine, monkeypatch):
    rec = VerifyRecorder(engine, monkeypatch)
    result = engine.generate(chat(PROMPTS[0]), max_tokens=48)
    assert rec.steps and result.stats.drafted > 0
    emitted = np.concatenate([out for _, out, _ in rec.steps])
    for argmax, out, n_accepted in rec.steps:
        assert len(out) == n_accepted + 1
        assert out.tolist() == argmax[:len(out)].tolist()
    # what the caller got is exactly what the steps emitted (up to the stop)
    assert result.tokens == emitted[:len(result.tokens)].tolist()


def test_greedy_tokens_match_a_plain_oracle_forward_pass(engine, pair_paths):
    """Independent check: re-evaluate prompt + output in one oracle pass. Batched logits differ
    slightly from one-token logits, so a mismatch is allowed only where the top two are near-tied."""
    prompt = engine.tokenize_prompt(chat(PROMPTS[1]))
    result = engine.generate(chat(PROMPTS[1]), max_tokens=40)
    from localspec.llama.context import LlamaModel

    with LlamaModel(pair_paths[0]) as model, LlamaContext(model, n_ctx=512) as ctx:
        seq = prompt + result.tokens
        logits = np.array(ctx.decode(seq, n_logits=len(result.tokens) + 1))  # [n+1, vocab]
    mismatches = 0
    for i, token in enumerate(result.tokens):
        row = logits[i]
        if row.argmax() != token:
            mismatches += 1
            assert row.max() - row[token] < 0.05, f"token {i} is not a near-tie: gap {row.max() - row[token]}"
    assert mismatches <= 2


def test_speculative_greedy_text_equals_oracle_alone_on_most_prompts(engine):
    same = 0
    for p in PROMPTS:
        spec = engine.generate(chat(p), max_tokens=48)
        base = engine.generate(chat(p), max_tokens=48, speculative=False)
        assert base.stats.drafted == 0 and spec.stats.drafted > 0
        same += spec.text == base.text
    assert same >= len(PROMPTS) - 1


def test_default_pair_acceptance_is_high(engine):
    """Over a few prompts: on one alone (a haiku) the draft may be unsure at every other token and
    stop early (its p_min cut-off), which says nothing about the pair."""
    steps = drafted = accepted = tokens = 0
    for p in PROMPTS:
        s = engine.generate(chat(p), max_tokens=64).stats
        steps, drafted, accepted, tokens = steps + s.steps, drafted + s.drafted, accepted + s.accepted, \
            tokens + s.completion_tokens
    assert accepted / drafted > 0.8
    assert accepted / steps > 2  # draft tokens accepted per step (measured here: 3.8 with k = 6)
    assert tokens / steps > 3


def test_cli_generate_json_on_the_default_pair():
    """The issue's acceptance check, as a user runs it. The default (adaptive) length is chosen from
    timings, so whether it drafts on this short reply depends on the machine's load: only its text
    is asserted; a fixed draft length shows the pair's acceptance."""
    import json
    import subprocess

    def run(*extra):
        out = subprocess.run(["localspec", "generate", "Write a haiku about the sea.", "--json", *extra],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout)

    adaptive, fixed, alone = run(), run("--draft-length", "4"), run("--no-draft")
    assert alone["text"] and alone["finish_reason"] in ("stop", "length")
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "draft_time", "verify_time",
                "prompt_tokens_evaluated", "time_to_first_token", "tokens_per_second"):
        assert key in adaptive["stats"]
    assert alone["stats"]["drafted"] == 0
    assert adaptive["text"] == fixed["text"] == alone["text"]
    assert fixed["stats"]["drafted"] > 0
    assert fixed["stats"]["acceptance_rate"] > 0.8


def test_cli_generate_output_is_whole_when_the_program_ends_at_once():
    """`localspec generate` ends without tearing the models down (`cli.exit_now`): what it printed,
    streamed text on stdout and the stats line on stderr, is all there, through pipes, and the exit
    status is 0. The same reply as `--json` gives."""
    import json
    import subprocess

    args = ["localspec", "generate", "Name three colours.", "--max-tokens", "20", "--threads", "2"]
    streamed = subprocess.run(args, capture_output=True, text=True, timeout=300)
    as_json = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300)
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    result = json.loads(as_json.stdout)
    assert streamed.stdout == result["text"] + "\n"
    assert f"[{result['stats']['completion_tokens']} tokens," in streamed.stderr


def test_cli_generate_into_a_reader_that_goes_away_ends_quietly():
    """`localspec generate ... | head -c 20`: once the reader has gone, the program stops with
    status 1 and no error message (as other Unix programs do), not 'error: [Errno 32] Broken pipe'."""
    import subprocess

    p = subprocess.Popen(["localspec", "generate", "Write a long story about a lighthouse keeper.",
                          "--max-tokens", "300", "--threads", "2", "--no-lookup"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(p.stdout.read(20)) == 20
    p.stdout.close()
    stderr = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1, stderr
    assert "error" not in stderr.lower() and "Traceback" not in stderr


def test_cli_generate_fits_its_context_to_the_prompt_and_answer():
    """Without --ctx a one-prompt `generate` sizes its context from the prompt's bytes and
    --max-tokens: never so small that the answer is cut short. A prompt of single-digit tokens
    (about a token per two bytes) and ~1200 bytes, in a context of 1536 (not the default 4096)."""
    import json
    import subprocess

    prompt = "Add these up: " + " ".join(str(i % 10) for i in range(600))
    out = subprocess.run(["localspec", "--debug", "generate", prompt, "--json", "--max-tokens", "24", "--threads", "2"],
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert result["stats"]["prompt_tokens"] > 600
    assert result["finish_reason"] == "length" and result["stats"]["completion_tokens"] == 24
    made = {int(line.rsplit("=", 1)[1]) for line in out.stderr.splitlines() if "llama_context: n_ctx  " in line}
    assert made == {1536}  # llama.cpp's own report of the contexts it made (oracle and draft)


def test_seeded_sampling_is_reproducible(engine):
    opts = dict(max_tokens=32, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02)
    a = engine.generate(chat(PROMPTS[2]), seed=1234, **opts)
    b = engine.generate(chat(PROMPTS[2]), seed=1234, **opts)
    assert a.tokens == b.tokens and a.text == b.text
    others = [engine.generate(chat(PROMPTS[2]), seed=s, **opts).tokens for s in (1, 2, 3)]
    assert any(o != a.tokens for o in others)
    assert a.stats.drafted > 0


def test_seeded_sampling_is_the_same_with_or_without_speculation(engine):
    """Seeded sampling draws each position's token with noise keyed by (seed, position), so the
    draft and its length cannot change the output (up to batched-logit near-ties)."""
    opts = dict(max_tokens=32, temperature=0.8, top_p=0.9)
    same = 0
    for seed, p in enumerate(PROMPTS[:4]):
        spec = engine.generate(chat(p), seed=seed, **opts)
        fixed2 = engine.generate(chat(p), seed=seed, draft_max=2, **opts)
        base = engine.generate(chat(p), seed=seed, speculative=False, **opts)
        assert spec.stats.accepted > 0
        same += spec.tokens == base.tokens == fixed2.tokens
    assert same >= 3


def test_a_negative_seed_is_a_seed_like_any_other(engine):
    """The OpenAI API takes any integer seed; numpy's generators take non-negative ones only."""
    opts = dict(max_tokens=6, temperature=0.9)
    a = engine.generate(chat(PROMPTS[0]), seed=-9999, **opts)
    b = engine.generate(chat(PROMPTS[0]), seed=-9999, speculative=False, **opts)
    assert a.tokens and a.tokens == b.tokens


def test_unseeded_sampling_varies(engine):
    runs = {tuple(engine.generate(chat(PROMPTS[0]), max_tokens=16, temperature=1.0).tokens) for _ in range(3)}
    assert len(runs) > 1


def test_max_tokens_is_never_exceeded(engine):
    for n in (1, 2, 5, 9):
        r = engine.generate(chat(PROMPTS[3]), max_tokens=n, speculative=True)
        assert len(r.tokens) <= n
    r = engine.generate(chat("Write a long story about a dragon."), max_tokens=7)
    assert len(r.tokens) == 7 and r.finish_reason == "length"


def test_stop_string_spanning_tokens(engine):
    full = engine.generate(chat(PROMPTS[2]), max_tokens=48)
    # a stop string made of the text of two consecutive tokens in the middle of the output
    model = engine.oracle_model
    i = len(full.tokens) // 2
    stop = model.detokenize(full.tokens[i:i + 2])
    assert len(stop.strip()) >= 2
    cut = full.text.index(stop)
    r = engine.generate(chat(PROMPTS[2]), max_tokens=48, stop=[stop, "never-appears"])
    assert r.finish_reason == "stop"
    assert r.text == full.text[:cut]
    assert stop not in r.text
    streamed = "".join(c.text for c in engine.stream(chat(PROMPTS[2]), max_tokens=48, stop=stop))
    assert streamed == r.text


def test_end_of_generation(engine):
    r = engine.generate(chat("Reply with only the word: yes"), max_tokens=64)
    assert r.finish_reason == "stop"
    assert len(r.tokens) < 64
    assert not any(engine.oracle_model.is_eog(t) for t in r.tokens)


def test_prefix_reuse(engine):
    msgs = chat("Name a colour.")
    first = engine.generate(msgs, max_tokens=16)
    again = engine.generate(msgs, max_tokens=16)
    assert again.stats.prompt_tokens_evaluated == 1
    assert again.text == first.text
    turn2 = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another one?"}]
    second = engine.generate(turn2, max_tokens=16)
    assert second.stats.prompt_tokens_evaluated < second.stats.prompt_tokens / 2


def test_streaming_matches_generate(engine):
    chunks = list(engine.stream(chat(PROMPTS[4]), max_tokens=40))
    r = engine.generate(chat(PROMPTS[4]), max_tokens=40)
    assert "".join(c.text for c in chunks) == r.text
    assert sum((c.tokens for c in chunks), []) == r.tokens
    assert chunks[-1].finish_reason == r.finish_reason and chunks[-1].stats is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert len(chunks) > 2  # text arrives step by step


def test_logprobs_are_the_oracles(engine):
    r = engine.generate(chat(PROMPTS[3]), max_tokens=8, logprobs=3)
    assert r.logprobs is not None and len(r.logprobs) == len(r.tokens)
    for lp, token in zip(r.logprobs, r.tokens):
        assert lp.token == token
        assert lp.logprob <= 0
        assert len(lp.top) == 3
        assert lp.top[0].logprob >= lp.logprob - 1e-6  # greedy: the emitted token is the top one
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(PromptTooLongError):
        engine.generate("word " * 3000, max_tokens=4)


def test_context_full_finishes_with_length_and_stays_usable(pair_paths):
    oracle, draft = pair_paths
    with Engine(oracle, draft, n_ctx=96) as small:
        r = small.generate(chat("Write a long story about a dragon and a knight."), max_tokens=500)
        assert r.finish_reason == "length"
        n_ctx = small.n_ctx  # llama.cpp may round the size up
        assert n_ctx < 41 + 500
        assert r.stats.prompt_tokens + len(r.tokens) <= n_ctx + 1
        assert len(small.oracle.seq_tokens()) <= n_ctx
        again = small.generate(chat("Say hi."), max_tokens=8)
        assert again.tokens and again.finish_reason in ("stop", "length")


def test_oracle_alone_engine(pair_paths):
    with Engine(pair_paths[0], None, n_ctx=512) as alone:
        r = alone.generate(chat(PROMPTS[0]), max_tokens=12)
        assert r.stats.drafted == 0 and r.stats.steps == len(r.tokens)
