"""`localspec chat`: the conversation logic against a scripted fake engine (fast), then the real
command on the default pair through a pseudo-terminal (pexpect) and through a pipe, and the
one-line errors for bad models."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import pexpect
import pytest

from localspec.runtime.engine import PromptTooLongError
from localspec.outputs import Chunk, Stats
from localspec.speculative.policy import FixedLength
from localspec.outputs import StepRecord
from localspec.speculative.costs import estimated_speedup, speedup
from localspec.cli.repl import Chat, Console, Settings
from localspec.options import GenerationOptions

CLI = [sys.executable, "-m", "localspec.cli"]
# one thread: the test machine is shared, and llama.cpp's spinning threads collapse under contention
FAST = ["--threads", "1", "--max-tokens", "24"]


# ---------------------------------------------------------------- a scripted engine


class _Path:
    def __init__(self, name: str) -> None:
        self.name = name


class _Model:
    def __init__(self, name: str) -> None:
        self.path = _Path(name)


class FakeEngine:
    """Tokens are words (+4 per message); each reply is `reply_words` words, one chunk per word."""

    def __init__(self, n_ctx: int = 4096, reply_words: int = 5, on_chunk=None) -> None:
        self.n_ctx = n_ctx
        self.reply_words = reply_words
        self.on_chunk = on_chunk  # called with the chunk index before each chunk is yielded
        self.calls: list[tuple[list[dict], GenerationOptions]] = []
        self.closed_early = 0
        self.proposer = object()
        self.policy = FixedLength(4)
        self.oracle_model, self.draft_model = _Model("oracle.gguf"), _Model("draft.gguf")

    def tokenize_prompt(self, messages) -> list[int]:
        return [0] * sum(4 + len(m["content"].split()) for m in messages)

    def stream(self, messages, options=None, **changes):
        options = GenerationOptions.build(options, **changes)
        n = len(self.tokenize_prompt(messages))
        if n >= self.n_ctx:
            raise PromptTooLongError(f"the prompt has {n} tokens; the context holds {self.n_ctx}")
        self.calls.append(([dict(m) for m in messages], options))
        return self._gen(n, min(options.max_tokens, self.reply_words), options.speculative)

    def _gen(self, n_prompt: int, n: int, speculative: bool):
        finished = False
        try:
            for i in range(n):
                if self.on_chunk:
                    self.on_chunk(i)
                last = i == n - 1
                stats = None
                if last:
                    # one step per word: the first a plain one-token step (20 ms), the rest draft 2 words
                    # (10 ms) and see 1 accepted, in a 30 ms verify pass (with drafting off: 20 ms steps)
                    records = [StepRecord(0, 0, 0, 0.0, 0.02, n_prompt + i) if i == 0 or not speculative
                               else StepRecord(2, 2, 1, 0.01, 0.03, n_prompt + i) for i in range(n)]
                    stats = Stats(prompt_tokens=n_prompt, prompt_tokens_evaluated=n_prompt, completion_tokens=n,
                                  steps=n, drafted=sum(r.drafted for r in records),
                                  accepted=sum(r.accepted for r in records),
                                  draft_time=sum(r.draft_time for r in records),
                                  verify_time=sum(r.verify_time for r in records), total_time=0.1, records=records)
                yield Chunk(f"w{i} " if not last else f"w{i}", [i], None, "stop" if last else None, stats)
            finished = True
        finally:
            if not finished:
                self.closed_early += 1


def run(engine, lines, settings=None, system=None):
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(engine, Console(out, err, color=False), settings or Settings(), system)
    chat.run_lines(lines)
    return chat, out.getvalue(), err.getvalue()


def test_set_validates_values_and_a_bad_value_keeps_the_session():
    engine = FakeEngine()
    chat, out, err = run(engine, ["/set temperature abc", "/set top_p 0", "/set top_k -1", "/set nope 1",
                                  "/set temperature", "/set temperature 0.5", "/set seed 7", "/set draft_max 2",
                                  "hello there"])
    errors = err.strip().splitlines()
    assert [e.split(":")[0] for e in errors[:5]] == ["error"] * 5, err
    assert "/set temperature: temperature must be a finite number >= 0 (0 = greedy), got 'abc'" in errors[0]
    assert "(0, 1]" in errors[1] and ">= 0" in errors[2] and "unknown setting 'nope'" in errors[3]
    assert "missing value" in errors[4]
    (messages, options), = engine.calls
    assert options.temperature == 0.5 and options.seed == 7 and options.draft_max == 2
    assert messages == [{"role": "user", "content": "hello there"}]
    assert out.strip() == "w0 w1 w2 w3 w4"


def test_history_keeps_replies_verbatim_and_system_and_reset():
    engine = FakeEngine(reply_words=3)
    chat, out, _ = run(engine, ["one", "/system be brief", "two", "/reset", "three"])
    assert engine.calls[1][0] == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "one"},
                                  {"role": "assistant", "content": "w0 w1 w2"},
                                  {"role": "user", "content": "two"}]
    assert engine.calls[2][0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "three"}]
    assert chat.totals.replies == 3


def test_a_full_context_drops_the_oldest_exchanges_but_keeps_the_system_message():
    # n_ctx 64, replies of 5 words, max_tokens 10: each exchange costs 4+2 + 4+5 = 15 tokens
    engine = FakeEngine(n_ctx=64, reply_words=5)
    chat, out, err = run(engine, [f"message number {i}" for i in range(6)], settings=Settings(max_tokens=10),
                         system="sys")
    assert "dropped the" in err and "oldest exchange" in err
    for messages, options in engine.calls:
        assert messages[0] == {"role": "system", "content": "sys"}
        assert len(engine.tokenize_prompt(messages)) + options.max_tokens <= engine.n_ctx
    assert engine.calls[-1][0][-1] == {"role": "user", "content": "message number 5"}
    assert engine.calls[-1][0][1] != {"role": "user", "content": "message number 0"}
    assert chat.totals.replies == 6


def test_a_message_longer_than_the_context_is_an_error_line_and_the_session_goes_on():
    engine = FakeEngine(n_ctx=64)
    chat, out, err = run(engine, ["first", "word " * 80, "short one"], settings=Settings(max_tokens=8))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: the message is too long: 84 prompt tokens, the context holds 64"], err
    assert "dropped" not in err  # the history is not sacrificed for a message that cannot fit anyway
    assert [m for m, _ in engine.calls][-1] == [{"role": "user", "content": "first"},
                                                {"role": "assistant", "content": "w0 w1 w2 w3 w4"},
                                                {"role": "user", "content": "short one"}]


def test_sigint_stops_the_reply_between_chunks_and_keeps_the_partial_reply():
    sent = []

    def ctrl_c_once(i):
        if i == 3 and not sent:
            sent.append(i)
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under nohup
    engine = FakeEngine(reply_words=50, on_chunk=ctrl_c_once)
    chat, out, err = run(engine, ["tell me a long story", "next"])
    assert engine.closed_early == 1
    assert "[interrupted after 4 tokens" in err
    first_reply = engine.calls[1][0][1]
    assert first_reply == {"role": "assistant", "content": "w0 w1 w2 w3 "}
    assert chat.totals.interrupted == 1 and chat.totals.replies == 1
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_stats_estimate_speedup_from_the_recorded_steps():
    assert speedup(1.0, 0.1, 0.4) == pytest.approx(2.0)
    assert speedup(1.0, 0.0, 0.0) is None and speedup(None, 0.1, 0.4) is None
    engine = FakeEngine(reply_words=4)
    chat, out, err = run(engine, ["hi", "/stats"])
    # 4 steps: one plain (1 token, 20 ms), three that emit 2 tokens each in 10 + 30 ms. The oracle
    # alone: 7 tokens x 20 ms (its one-token pass, fitted to the plain step) = 140 ms, against 140 ms
    assert len(engine.calls) == 1  # nothing is run to time the oracle
    assert "speedup vs oracle alone (estimate): 1.00x last reply" in out
    assert "oracle one-token step 20." in out  # 20 ms at the first step's context, the prior's slope after it
    assert "acceptance 50% (3/6)" in out and "prompt tokens evaluated: 5 of 5" in out
    # the same estimate from the reply's own steps (what the server's chat page shows); none
    # without a one-token step to fit the oracle's pass to
    assert estimated_speedup(chat.last) == pytest.approx(1.0, abs=0.005)
    assert estimated_speedup(Stats(records=[r for r in chat.last.records if r.drafted])) is None


# ---------------------------------------------------------------- errors: one line, exit code 2


@pytest.fixture(scope="module")
def not_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "notes.gguf"
    path.write_text("this is not a model\n")
    return path


@pytest.mark.parametrize("args, message", [
    (["--oracle", "no-such-model", "--no-draft"], "unknown model 'no-such-model'"),
    (["--pair", "no-such-pair"], "unknown pair 'no-such-pair'"),
    (["--oracle", "{not_gguf}", "--no-draft"], "not a GGUF file"),
    (["--oracle", "/nonexistent/model.gguf", "--no-draft"], "not found"),
])
def test_bad_models_give_one_line_and_exit_code_2(args, message, not_gguf):
    args = [a.replace("{not_gguf}", str(not_gguf)) for a in args]
    p = subprocess.run(CLI + ["chat"] + args, input="hello\n", capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localspec: error:") and message in lines[0], p.stderr


def test_bad_option_value_is_a_usage_error():
    p = subprocess.run(CLI + ["chat", "--temperature", "-1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--temperature" in p.stderr


# ---------------------------------------------------------------- the real command


@pytest.fixture
def chat_env(tmp_path):
    return dict(os.environ, LOCALSPEC_CHAT_HISTORY=str(tmp_path / "history"), TERM="xterm")


def spawn(env, *args):
    child = pexpect.spawn(CLI[0], CLI[1:] + ["chat", *FAST, *args], env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 250))
    child.expect_exact(">>> ")
    return child


def stats_of(child) -> dict[str, int]:
    child.sendline("/stats")
    child.expect(r"last reply: (\d+) tokens.*?prompt tokens evaluated: (\d+) of (\d+)")
    n, evaluated, total = map(int, child.match.groups())
    child.expect_exact(">>> ")
    return {"tokens": n, "evaluated": evaluated, "total": total}


@pytest.mark.model
def test_chat_in_a_terminal(chat_env, tmp_path):
    child = spawn(chat_env)
    child.sendline("What is the capital of France?")
    child.expect(r"\[(\d+) tokens · [\d.]+ tok/s")
    reply1 = child.before
    assert "Paris" in reply1
    child.expect_exact(">>> ")
    turn1 = stats_of(child)

    child.sendline("And what is the capital of Spain?")
    child.expect(r"\[(\d+) tokens")
    child.expect_exact(">>> ")
    turn2 = stats_of(child)
    # the KV cache kept turn 1: only the new turn's tokens were evaluated
    assert turn2["total"] > turn1["total"] + turn1["tokens"]
    assert turn2["total"] - turn2["evaluated"] >= turn1["total"] - 1
    assert turn2["evaluated"] < turn2["total"] / 2, turn2

    child.sendline("/set temperature 0.5")
    child.expect_exact("temperature = 0.5")
    child.expect_exact(">>> ")
    child.sendline("/set temperature hot")
    child.expect_exact("error: /set temperature: temperature must be a finite number >= 0 (0 = greedy), got 'hot'")
    child.expect_exact(">>> ")
    child.sendline("/set temperature 0")
    child.expect_exact("temperature = 0.0")

    # Ctrl-C stops a long reply; the prompt comes back and the session goes on
    child.sendline("/set max_tokens 1000")
    child.expect_exact(">>> ")
    child.sendline("/reset")
    child.expect_exact(">>> ")
    child.sendline("Write a very long story about a dragon.")
    child.expect_exact("dragon.\r\n")
    child.expect(r"\w+ \w+ \w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect(r"\[interrupted after (\d+) tokens")
    assert int(child.match.group(1)) < 1000
    child.expect_exact(">>> ")
    child.sendline("/set max_tokens 24")
    child.expect_exact(">>> ")
    child.sendline("What was the dragon called?")
    child.expect(r"\[(\d+) tokens · ")
    child.expect_exact(">>> ")

    child.sendintr()  # at the prompt: a fresh prompt, not an exit
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = (tmp_path / "history").read_text()
    assert "What is the capital of France?" in history and "/set temperature 0.5" in history


@pytest.mark.model
def test_ctrl_d_leaves(chat_env):
    child = spawn(chat_env)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.model
def test_chat_through_a_pipe_writes_no_escape_codes(chat_env):
    filler = "Here is a list of fruit: " + "apple banana cherry plum " * 18 + "."
    lines = ["What is the capital of France?", "/stats", filler + " Which fruit comes first?",
             filler + " Which fruit comes last?", "word " * 400, "Thanks!", "/exit", "never sent"]
    p = subprocess.run(CLI + ["chat", *FAST, "--ctx", "256"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=120, env=chat_env)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x1b" not in p.stderr
    assert "Paris" in p.stdout and "prompt tokens evaluated" in p.stdout and ">>>" not in p.stdout
    summaries = re.findall(r"^\[(\d+) tokens", p.stderr, re.M)
    assert len(summaries) == 4, p.stderr  # four messages answered; the too-long one and "never sent" not
    assert "context full (256 tokens): dropped the" in p.stderr
    assert re.search(r"^error: the message is too long: \d+ prompt tokens, the context holds 256$", p.stderr, re.M)
    assert "Traceback" not in p.stderr
