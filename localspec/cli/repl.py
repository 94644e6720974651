"""`localspec chat`: an interactive (or piped) multi-turn chat over `Engine.stream`.

The conversation is kept as chat messages and rendered with the model's template every turn; the
engine keeps the evaluated prefix in its KV cache, so a turn only evaluates the tokens it adds.
Assistant turns are stored exactly as generated. No generation logic lives here.

Ctrl-C during a reply stops it between two speculative steps (the engine's generator is closed,
so its caches stay consistent); the partial reply stays in the history. A second Ctrl-C before the
step finishes leaves the chat. Ctrl-C at the prompt clears the line; Ctrl-D or /exit leaves.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, TextIO

import click

from localspec.speculative.costs import estimated_speedup, fit_steps
from localspec.options import GenerationOptions
from localspec.outputs import Stats, StepRecord

PROMPT = ">>> "

HELP = """\
commands:
  /help                 this help
  /reset                forget the conversation (the system message stays)
  /system [TEXT|none]   show, set or clear the system message
  /set [NAME VALUE]     show the settings, or set one: temperature, top_p, top_k, min_p,
                        seed (none: random), max_tokens, draft_max (none: the engine's)
  /stats                last reply and session: acceptance, tokens/s, prompt tokens evaluated, speedup
  /exit                 leave (or Ctrl-D)
Ctrl-C stops the current reply (the partial reply stays in the conversation).
A line starting with // sends a message that starts with /."""


class SettingError(ValueError):
    pass


# ---------------------------------------------------------------- settings

Settings = GenerationOptions  # the chat's per-reply options; `/set NAME VALUE` replaces one
SETTABLE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "draft_max")


def set_option(settings: Settings, name: str, value: str) -> tuple[str, Settings]:
    """`/set NAME VALUE`: the option's name and the settings with it changed (parsed and checked
    by the option's rule). SettingError says what is wrong."""
    key = name.lower().replace("-", "_")
    if key not in SETTABLE:
        raise SettingError(f"unknown setting {name!r} (one of {', '.join(SETTABLE)})")
    try:
        return key, settings.with_text(key, value)
    except ValueError as e:
        raise SettingError(str(e)) from None


def describe(settings: Settings) -> str:
    return "  ".join(f"{name}={getattr(settings, name)}" for name in SETTABLE)


# ---------------------------------------------------------------- conversation


@dataclass
class Conversation:
    """The system message (optional) and alternating user/assistant turns."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def reset(self) -> None:
        self.turns.clear()

    def drop_oldest(self) -> bool:
        """Drop the oldest exchange (a user message and its reply), never the last message."""
        if len(self.turns) <= 1:
            return False
        n = 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1
        del self.turns[:n]
        return True


@dataclass
class Totals:
    """Stats summed over the session's completed replies."""

    replies: int = 0
    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0
    completion_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    suffix_drafted: int = 0
    suffix_accepted: int = 0
    draft_time: float = 0.0
    draft_prompt_time: float = 0.0
    verify_time: float = 0.0
    host_draft_time: float = 0.0
    host_verify_time: float = 0.0
    host_other_time: float = 0.0
    generation_time: float = 0.0
    interrupted: int = 0
    records: list[StepRecord] = field(default_factory=list, repr=False)  # every step of every reply

    SUMMED = ("prompt_tokens", "prompt_tokens_evaluated", "completion_tokens", "steps", "drafted", "accepted",
              "lookup_drafted", "lookup_accepted", "suffix_drafted", "suffix_accepted", "draft_time", "draft_prompt_time", "verify_time",
              "host_draft_time", "host_verify_time", "host_other_time")  # the Stats counters kept as session sums

    def add(self, s: Stats) -> None:
        self.replies += 1
        for name in self.SUMMED:
            setattr(self, name, getattr(self, name) + getattr(s, name))
        self.generation_time += max(0.0, s.generation_time)
        self.records += s.records


# ---------------------------------------------------------------- terminal


class Console:
    """Where the chat writes. `color=False` (piped input, or not a terminal) writes no escape codes;
    in piped mode stdout carries only the replies and command output, the rest goes to stderr."""

    def __init__(self, out: TextIO, err: TextIO, *, color: bool) -> None:
        self.out, self.err, self.color = out, err, color

    def _style(self, text: str, **style) -> str:
        return click.style(text, **style) if self.color else text

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def line(self, text: str = "") -> None:
        self.write(text + "\n")

    def info(self, text: str) -> None:
        """A dim status line (reply summary, notices)."""
        self.err.write(self._style(text, dim=True) + "\n")
        self.err.flush()

    def error(self, text: str) -> None:
        self.err.write(self._style(f"error: {text}", fg="red") + "\n")
        self.err.flush()

    def prompt(self) -> str:
        if not self.color:
            return PROMPT
        # \001..\002 tell readline the escape codes take no room on screen
        return f"\001{click.style('', bold=True, fg='green', reset=False)}\002{PROMPT}\001{click.style('', reset=True)}\002"


class _Interrupts:
    """While active, the first Ctrl-C only sets `.hit` (the reply stops at the next chunk); a second
    one raises KeyboardInterrupt. Outside, Ctrl-C behaves as before."""

    def __init__(self) -> None:
        self.hit = False
        self._previous: Any = None

    def _handler(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> "_Interrupts":
        self.hit = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: no signal handling
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def history_file() -> Path | None:
    """$LOCALSPEC_CHAT_HISTORY (empty: no history file), else chat_history in the localspec cache."""
    env = os.environ.get("LOCALSPEC_CHAT_HISTORY")
    if env is not None:
        return Path(env).expanduser() if env else None
    from localspec.cache import cache_dir

    return cache_dir() / "chat_history"


class _LineEditor:
    """Terminal input with the stdlib readline: editing, history (kept in a file), Tab-completed
    slash commands. Without readline, plain input()."""

    COMMANDS = ("/help", "/reset", "/system ", "/set ", "/stats", "/exit")

    def __init__(self) -> None:
        self.path = history_file()
        try:
            import readline
        except ImportError:  # e.g. Windows without pyreadline
            self.readline = None
            return
        self.readline = readline
        readline.set_history_length(1000)
        readline.set_completer_delims(" \t\n")
        readline.set_completer(self._complete)
        readline.parse_and_bind("tab: complete")
        if self.path is not None and self.path.exists():
            try:
                readline.read_history_file(str(self.path))
            except OSError:
                pass

    def _complete(self, text: str, state: int) -> str | None:
        matches = [c for c in self.COMMANDS if c.startswith(text)] if text.startswith("/") else []
        return matches[state] if state < len(matches) else None

    def save(self) -> None:
        if self.readline is None or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.path))
        except OSError:
            pass


# ---------------------------------------------------------------- the chat


def _acceptance(x) -> str:
    """/stats' acceptance of a reply's or the session's stats: the rate, how many of the accepted
    tokens were free (prompt lookup, the suffix cache), the mean accepted length."""
    if not x.drafted:
        return "acceptance n/a (nothing drafted)"
    free = [f"{n} of them from {name}" for n, name in ((x.lookup_accepted, "prompt lookup"),
                                                       (x.suffix_accepted, "the suffix cache")) if n]
    return f"acceptance {x.accepted / x.drafted:.0%} ({x.accepted}/{x.drafted}" \
           + "".join(f", {f}" for f in free) + "), " \
           f"mean accepted length {x.accepted / x.steps if x.steps else 0:.2f}"


class Chat:
    """Conversation state, slash commands and rendering over one engine."""

    def __init__(self, engine, console: Console, settings: Settings | None = None,
                 system: str | None = None) -> None:
        self.engine = engine
        self.console = console
        self.settings = settings or Settings()
        self.conversation = Conversation(system=system or None)
        self.totals = Totals()
        self.last: Stats | None = None
        self.speculative = engine.proposer is not None

    # -- input

    def handle(self, line: str) -> bool:
        """One line of input: a slash command or a message. False: leave the chat."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("//"):
            line = line[1:]
        elif line.startswith("/"):
            return self.command(line)
        self.reply(line)
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        c = self.console
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            c.line(HELP)
        elif name == "/reset":
            self.conversation.reset()
            c.info("conversation cleared")
        elif name == "/system":
            if not arg:
                c.line(f"system message: {self.conversation.system!r}" if self.conversation.system
                       else "no system message (the model's template default applies)")
            elif arg.lower() == "none":
                self.conversation.system = None
                c.info("system message cleared")
            else:
                self.conversation.system = arg
                c.info("system message set")
        elif name == "/set":
            parts = arg.split(None, 1)
            if not parts:
                c.line(describe(self.settings))
            elif len(parts) != 2:
                c.error(f"/set {parts[0]}: missing value (usage: /set NAME VALUE)")
            else:
                try:
                    key, self.settings = set_option(self.settings, parts[0], parts[1].strip())
                except SettingError as e:
                    c.error(f"/set {parts[0]}: {e}")
                else:
                    c.info(f"{key} = {getattr(self.settings, key)}")
        elif name == "/stats":
            for text in self.stats_lines():
                c.line(text)
        else:
            c.error(f"unknown command {name} (/help lists them)")
        return True

    # -- replies

    def _fit(self, max_tokens: int) -> tuple[list[dict[str, str]], int] | None:
        """The messages to send and the reply budget: drop the oldest exchanges (keeping the system
        message) until prompt + max_tokens fits the context. None: the message cannot fit at all."""
        n_ctx = self.engine.n_ctx
        head = [{"role": "system", "content": self.conversation.system}] if self.conversation.system else []
        n_alone = len(self.engine.tokenize_prompt(head + self.conversation.turns[-1:]))
        if n_alone >= n_ctx:  # cannot fit even alone: keep the history as it is
            self.console.error(f"the message is too long: {n_alone} prompt tokens, the context holds {n_ctx}")
            return None
        dropped = 0
        while True:
            messages = self.conversation.messages()
            n_prompt = len(self.engine.tokenize_prompt(messages))
            if n_prompt + max_tokens <= n_ctx or not self.conversation.drop_oldest():
                break
            dropped += 1
        if dropped:
            self.console.info(f"context full ({n_ctx} tokens): dropped the {dropped} oldest "
                              f"exchange{'s' if dropped > 1 else ''}")
        if n_prompt + max_tokens > n_ctx:
            max_tokens = n_ctx - n_prompt
            self.console.info(f"this reply is limited to {max_tokens} tokens by the context")
        return messages, max_tokens

    def reply(self, text: str) -> None:
        c = self.console
        self.conversation.add("user", text)
        try:
            fitted = self._fit(self.settings.max_tokens)
            if fitted is None:
                self.conversation.turns.pop()
                return
            messages, max_tokens = fitted
            it = self.engine.stream(messages, self.settings, max_tokens=max_tokens)  # raises eagerly on bad input
        except ValueError as e:  # PromptTooLongError, ChatTemplateError
            self.conversation.turns.pop()
            c.error(str(e))
            return

        parts: list[str] = []
        n_tokens = 0
        final = None
        t0 = time.perf_counter()
        try:
            with _Interrupts() as interrupts:
                for chunk in it:
                    if chunk.text:
                        c.write(chunk.text)
                        parts.append(chunk.text)
                    n_tokens += len(chunk.tokens)
                    if chunk.finish_reason is not None:
                        final = chunk
                    if interrupts.hit:
                        break
        finally:
            it.close()  # stops between steps; the engine's caches stay consistent
        reply = "".join(parts)
        if reply and not reply.endswith("\n"):
            c.write("\n")

        if final is None:  # interrupted
            self.totals.interrupted += 1
            if parts:
                self.conversation.add("assistant", reply)  # kept as far as it got
            else:
                self.conversation.turns.pop()  # nothing generated: forget the message too
            dt = time.perf_counter() - t0
            c.info(f"[interrupted after {n_tokens} tokens, {dt:.1f} s]")
            return
        self.conversation.add("assistant", reply)
        s = final.stats
        self.last = s
        self.totals.add(s)
        summary = f"[{s.completion_tokens} tokens · {s.tokens_per_second:.1f} tok/s · "
        if s.drafted:
            summary += f"acceptance {s.acceptance_rate:.0%}"
        else:
            summary += ("nothing drafted" + (" (/stats says why)" if s.idle_reason else "")) if self.speculative \
                else "oracle alone"
        if final.finish_reason == "length":
            summary += " · stopped at max_tokens"
        c.info(summary + "]")

    # -- /stats

    def stats_lines(self) -> list[str]:
        s, t = self.last, self.totals
        if s is None:
            return ["no completed reply yet"]
        session_tps = t.completion_tokens / t.generation_time if t.generation_time > 0 else 0.0
        lines = [
            f"last reply: {s.completion_tokens} tokens in {s.steps} step{'s' if s.steps != 1 else ''}, "
            f"{_acceptance(s)}, {s.tokens_per_second:.1f} tok/s",
            f"  prompt tokens evaluated: {s.prompt_tokens_evaluated} of {s.prompt_tokens} "
            f"({s.prompt_tokens - s.prompt_tokens_evaluated} reused from the cache)",
            f"session: {t.replies} repl{'ies' if t.replies != 1 else 'y'}"
            + (f" (+{t.interrupted} interrupted, not counted)" if t.interrupted else "")
            + f", {t.completion_tokens} tokens, {_acceptance(t)}, {session_tps:.1f} tok/s",
            f"  prompt tokens evaluated: {t.prompt_tokens_evaluated} of {t.prompt_tokens}",
            f"draft length: {self._draft_length(s)}",
        ]
        if s.steps:
            lines.append(f"host time (outside llama.cpp): {s.host_ms_per_token:.2f} ms a token, "
                         f"{s.host_ms_per_step:.2f} ms a step (proposing {1000 * s.host_draft_time / s.steps:.2f}, "
                         f"verifying {1000 * s.host_verify_time / s.steps:.2f}, the rest "
                         f"{1000 * s.host_other_time / s.steps:.2f}) last reply")
        if self.speculative and s.regime:
            lines.append(f"  sampling regime: {s.regime} (the policy's estimates are kept per regime)")
        if self.speculative and s.idle_reason:
            lines.append(f"  drafting idle for {s.idle_steps} of {s.steps} steps of the last reply: {s.idle_reason}")
        lines.append(self._speedup_line(s, t))
        return lines

    def _draft_length(self, s) -> str:
        """/stats' draft length: the policy's, its cap, and what the last reply (`s`) drafted a step."""
        if not self.speculative:
            return "none (the oracle runs alone)"
        draft = self.engine.policy.describe()
        if self.settings.draft_max is not None:
            draft += f", capped at {self.settings.draft_max} by /set draft_max"
        return draft + f"; drafted per step: {s.drafted / s.steps if s.steps else 0:.2f} last reply"

    def _speedup_line(self, s, t) -> str:
        """/stats' speedup over the oracle alone, for the last reply (`s`) and the session (`t`)."""
        if not self.speculative:
            return "speedup vs oracle alone: 1.00x (this is the oracle alone)"
        # the oracle alone's time for the same tokens, from the one-token pass fitted to the session's
        # own steps (every reply's first step is one): nothing is timed on purpose
        fit = fit_steps(t.records)
        if fit is None:
            return "speedup vs oracle alone: n/a (no one-token oracle step recorded yet)"
        verify, _ = fit
        last, sess = estimated_speedup(s, verify), estimated_speedup(t, verify)

        def fmt(x: float | None) -> str:
            return f"{x:.2f}x" if x is not None else "n/a"

        per_step = (s.draft_time + s.verify_time) / s.steps if s.steps else 0.0
        context = s.records[-1].context if s.records else 0
        return (f"speedup vs oracle alone (estimate): {fmt(last)} last reply, {fmt(sess)} session; "
                f"oracle one-token step {verify(1, context) * 1000:.1f} ms (fitted to this session's steps), "
                f"speculative step {per_step * 1000:.1f} ms for {s.tokens_per_step:.2f} tokens")

    # -- loops

    def banner(self) -> str:
        e = self.engine
        oracle = e.oracle_model.path.name
        if e.draft_model is not None:
            draft = f"draft {e.draft_model.path.name}"
        elif e.proposer is not None:
            draft = f"draft: {type(e.proposer).__name__}"
        else:
            draft = "no draft (oracle alone)"
        return (f"localspec chat · oracle {oracle} · {draft} · ctx {e.n_ctx}\n"
                "/help for commands · Ctrl-C stops a reply · Ctrl-D or /exit leaves")

    def run_interactive(self, editor: _LineEditor) -> None:
        c = self.console
        c.info(self.banner())
        try:
            while True:
                try:
                    line = input(c.prompt())
                except KeyboardInterrupt:  # at the prompt: drop the line
                    c.write("\n")
                    continue
                except EOFError:  # Ctrl-D
                    c.write("\n")
                    return
                if not self.handle(line):
                    return
        finally:
            editor.save()

    def run_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            if not self.handle(line.rstrip("\r\n")):
                return


def run_chat(engine, *, settings: Settings, system: str | None = None,
             stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the chat until /exit, Ctrl-D or end of input. Interactive when stdin is a terminal;
    otherwise one message per input line and no escape codes. Returns the exit code."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    interactive = stdin.isatty()
    console = Console(stdout, stderr, color=interactive and stdout.isatty())
    chat = Chat(engine, console, settings, system)
    try:
        if interactive:
            chat.run_interactive(_LineEditor())
        else:
            chat.run_lines(stdin)
    except KeyboardInterrupt:  # a second Ctrl-C during a reply
        console.write("\n")
        console.error("interrupted")
        return 130
    return 0

