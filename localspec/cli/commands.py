"""The `localspec` command: a thin layer over `localspec.runtime.engine.Engine`."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any

import click

from localspec import __version__
from localspec.cli.console import EXIT_INTERRUPTED, EXIT_RECORDS_FAILED, UserError, friendly_errors, progress
from localspec.cli.flags import (DEFAULT_BATCH_PARALLEL, DEFAULT_SERVE_PARALLEL, fitted_context, model_options,
                                 open_engine, request_options, sampling_options, structure_options)
from localspec.options import OPTIONS
from localspec.outputs import Structure


_PROGRAM = False  # set by `entry`, the program's start; not when click's test runner calls `main` in-process


def entry() -> None:
    """The `localspec` program (pyproject's script; `python -m localspec.cli`)."""
    global _PROGRAM
    _PROGRAM = True
    main()


def exit_now() -> None:
    """End the program here, its output flushed, without tearing anything down: freeing the models
    and contexts and finalizing the interpreter cost a fresh `localspec generate` ~35-50 ms (the
    default pair, `--max-tokens 1 --json`, median of 15 processes: 0.668 s against 0.701 s), work
    the system does anyway when the process ends. mypy ends its runs this way (`mypy.util.hard_exit`).
    Only where nothing is left to write but what is flushed here; a no-op inside another program (a
    test calling `main`)."""
    if not _PROGRAM:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can reach it
            pass
    logging.shutdown()
    os._exit(0)


# ---------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show llama.cpp's log and tracebacks.")
@click.version_option(version=__version__, prog_name="localspec")
def main(debug: bool) -> None:
    """localspec: faster local generation with speculative decoding, same output."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("localspec.llama.context").setLevel(logging.DEBUG if debug else logging.ERROR)


@main.command()
@click.argument("prompt", required=False)
@model_options
@sampling_options
@click.option("--system", default=None, help="System message.")
@click.option("--raw", is_flag=True, help="Send PROMPT as plain text, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, finish_reason, tokens, stats.")
@click.option("--input", "input_path", type=click.Path(exists=True, dir_okay=False, allow_dash=True), default=None,
              help="Batch: a JSONL file of requests ({\"id\", \"prompt\" | \"messages\", sampling fields}).")
@click.option("--output", "output_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Batch: the JSONL results file (appended; ids already in it are skipped). Default: stdout.")
@click.option("--parallel", type=click.IntRange(1, 64), default=None,
              help=f"Batch: requests generated at once, in one batch (default {DEFAULT_BATCH_PARALLEL}). Each "
                   "takes a KV cache of --ctx tokens.")
@structure_options
@friendly_errors
def generate(prompt: str | None, system: str | None, raw: bool, as_json: bool, input_path: str | None,
             output_path: str | None, parallel: int | None, json_schema: str | None, grammar: str | None,
             **kw) -> None:
    """Generate a reply to PROMPT (read from stdin when omitted or '-'), or run a JSONL batch (--input).
    --json-schema / --grammar constrain the output (JSONL lines may carry their own "json_schema" /
    "grammar").

    A batch exits 0 when every record of the input succeeded, 1 when any has an error record in
    the output (written now or by an earlier run), 2 on a usage or model error, 130 on Ctrl-C."""
    options = request_options(kw, json_schema, grammar)
    if input_path is not None or output_path is not None:
        if input_path is None:
            raise UserError("--output needs --input")
        if prompt is not None:
            raise UserError("give either PROMPT or --input, not both")
        from localspec.cli.jobs import run_batch

        kw["parallel"] = parallel or DEFAULT_BATCH_PARALLEL
        try:
            summary = run_batch(input_path, output_path, open_engine=lambda: open_engine(**kw), defaults=options,
                                system=system, raw=raw, progress=progress)
        except KeyboardInterrupt:
            sys.exit(EXIT_INTERRUPTED)
        if not summary.ok:  # some id of the input has an error record: say so to scripts
            sys.exit(EXIT_RECORDS_FAILED)
        return
    if parallel is not None:
        raise UserError("--parallel applies to a batch (--input)")
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UserError("empty prompt")
    if raw:
        request: Any = prompt
    else:
        request = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if kw["n_ctx"] is None:
        kw["n_ctx"] = fitted_context([prompt, system or ""], options.max_tokens)
    with open_engine(**kw) as engine:
        if as_json:
            result = engine.generate(request, options)
            click.echo(json.dumps(result.to_dict(), ensure_ascii=False))
            exit_now()
            return
        final = None
        for final in engine.stream(request, options):
            click.echo(final.text, nl=False)
            sys.stdout.flush()
        click.echo()
        s = final.stats
        incomplete = ", INCOMPLETE: the output stopped before the schema/grammar was complete" \
            if final.structure is Structure.INCOMPLETE else ""
        click.echo(click.style(
            f"[{s.completion_tokens} tokens, {s.tokens_per_second:.1f} tok/s, acceptance "
            f"{s.acceptance_rate:.0%}, {s.mean_accepted_length:.2f} accepted/step, finish: {final.finish_reason}"
            f"{incomplete}]", dim=True), err=True)
        if s.idle_reason:
            click.echo(click.style(f"[drafting idle for {s.idle_steps} of {s.steps} steps: {s.idle_reason}]",
                                   dim=True), err=True)
        exit_now()


@main.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="System message.")
@friendly_errors
def chat(system: str | None, **kw) -> None:
    """Chat in the terminal; replies stream as drafts are accepted (/help inside for commands).
    With piped input: one message per line, replies on stdout."""
    from localspec.cli.repl import run_chat

    settings = request_options(kw)
    with open_engine(**kw) as engine:
        code = run_chat(engine, settings=settings, system=system)
    sys.exit(code)


@main.command()
@model_options
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A text file, one prompt per line (default: a few bundled chat, grounded and code prompts).")
@click.option("--max-prompts", type=click.IntRange(1), default=2, show_default=True, help="Per workload.")
@OPTIONS["max_tokens"].click_option(default=64)
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def check(prompts_file: str | None, max_prompts: int, max_tokens: int, as_json: bool, **kw) -> None:
    """Is this draft worth it for this oracle here? Compatibility, measured acceptance and costs,
    predicted and measured speedup, and a recommendation."""
    from localspec.cli.check import format_report, load_prompts, run_check
    from localspec.models import Registry

    if kw["no_draft"] or kw["draft"] == "ngram":
        raise UserError("check needs a draft model (--draft NAME or --pair NAME)")
    prompts = load_prompts(prompts_file, max_prompts, max_tokens)
    choice = Registry.load().choose(kw["pair"], kw["oracle"], kw["draft"])
    oracle, draft = choice.oracle, choice.draft or choice.pair.draft  # another oracle: still the pair's draft
    # the pair's own figures: its draft model alone (prompt lookup would mix in the text's repeats, the
    # suffix cache what earlier prompts said; and each prompt evaluated as it would be alone)
    with open_engine(**{**kw, "oracle": oracle, "draft": draft, "cross_tokenizer": True, "lookup": False,
                        "suffix_cache": 0, "prompt_cache_mib": 0}) as engine:
        report = run_check(engine, prompts, oracle=oracle, draft=draft, progress=progress)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report))


@main.command("models")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def models_cmd(as_json: bool) -> None:
    """List the known models and pairs, and which models are present."""
    from localspec.models import Registry

    reg = Registry.load()
    if as_json:
        click.echo(json.dumps({
            "models": [{"name": m.name, "present": reg.is_present(m.name), "path": str(reg.path_of(m.name)),
                        "quantization": m.quantization, "size": m.size, "description": m.description}
                       for m in reg.models.values()],
            "pairs": [{"name": p.name, "oracle": p.oracle, "draft": p.draft, "default": p.name == reg.default_pair}
                      for p in reg.pairs.values()]}, indent=2))
        return
    click.echo("MODELS")
    for m in reg.models.values():
        mark = "present" if reg.is_present(m.name) else "-"
        click.echo(f"  {m.name:<38} {m.quantization:<7} {m.size:>8}  {mark:<8} {m.description}")
    click.echo("PAIRS (oracle <- draft)")
    for p in reg.pairs.values():
        star = "*" if p.name == reg.default_pair else " "
        click.echo(f" {star}{p.name:<22} {p.oracle} <- {p.draft}   {p.description}")


@main.command()
@click.argument("names", nargs=-1, required=True)
@friendly_errors
def pull(names: tuple[str, ...]) -> None:
    """Fetch (or derive) models, or both models of a pair, into the cache. A download stopped
    short (Ctrl-C, a dropped connection) resumes when the same command runs again."""
    from localspec.models import DownloadInterrupted, Registry

    reg = Registry.load()
    for name in names:
        targets = [reg.pairs[name].oracle, reg.pairs[name].draft] if name in reg.pairs else [name]
        for target in targets:
            try:
                path = reg.pull(target, progress=progress)
            except KeyboardInterrupt as e:
                if isinstance(e, DownloadInterrupted):
                    raise  # friendly_errors says what the download kept
                progress(f"interrupted while fetching {target}")  # waiting, pip, quantizing, hashing
                sys.exit(EXIT_INTERRUPTED)
            click.echo(f"{target}: {path}")



API_KEY_ENV = "LOCALSPEC_API_KEY"


def resolve_api_key(ctx: click.Context, api_key: str | None, api_key_file: str | None) -> tuple[str, ...] | None:
    """The keys from --api-key-file (one a line), $LOCALSPEC_API_KEY or --api-key (in that order of
    preference); an empty or unusable key is an error, never "no auth"."""
    import os

    from click.core import ParameterSource

    on_command_line = ctx.get_parameter_source("api_key") == ParameterSource.COMMANDLINE
    if api_key_file is not None:
        if on_command_line:
            raise UserError("give either --api-key or --api-key-file, not both")
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.read().strip()  # one key a line
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-key-file {api_key_file}: {e}") from e
        source = f"--api-key-file {api_key_file}"
    elif on_command_line:
        source = "--api-key"
        progress("warning: --api-key on the command line is visible to every user of this machine (ps); "
                 f"prefer ${API_KEY_ENV} or --api-key-file")
    else:
        source = f"${API_KEY_ENV}"
        if api_key is None and API_KEY_ENV in os.environ:  # click reads an empty variable as unset
            api_key = ""
    if api_key is None:
        return None
    if not api_key:
        raise UserError(f"{source} is empty: give a key, or no key at all to serve without one")
    keys = tuple(line.strip() for line in api_key.splitlines() if line.strip())
    if not all(0x21 <= ord(c) <= 0x7E for key in keys for c in key):
        raise UserError(f"{source}: the key must be printable ASCII without spaces (it travels in an HTTP header)")
    return keys


def _is_loopback(host: str) -> bool:
    import ipaddress

    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--model-name", default=None,
              help="The model name clients send and /v1/models lists (default: the pair's name, or the oracle's).")
@click.option("--api-key", default=None, envvar=API_KEY_ENV, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1 routes and /metrics. Prefer $LOCALSPEC_API_KEY or "
                   "--api-key-file: a key on the command line shows in ps.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="Read the API key from this file (surrounding whitespace is dropped); several keys, one a "
                   "line, each draft from a suffix cache of their own.")
@click.option("--parallel", type=click.IntRange(1, 64), default=DEFAULT_SERVE_PARALLEL, show_default=True,
              help="Requests generated at once (slots), in one batch: each takes a KV cache of --ctx tokens.")
@click.option("--max-queue", type=click.IntRange(0), default=32, show_default=True,
              help="Requests that may wait for a slot; more get 429.")
@click.option("--max-body", type=click.IntRange(1024), default=4 * 1024 * 1024, show_default=True,
              help="Largest request body in bytes; larger gets 413.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=None,
              help="Most tokens one request may generate: larger max_tokens are clamped to it, and chat requests "
                   "without max_tokens get it (default: half of --ctx).")
@click.option("--time-limit", type=click.FloatRange(0), default=600, show_default=True,
              help="Seconds one generation may run; it then ends with finish_reason 'length' (0: no limit).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="A web origin allowed to call the server from a browser, e.g. http://localhost:3000 "
                   "(repeatable; '*' for any). Other web pages get 403.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also answer requests for this host name (repeatable; '*.example.com' for a domain, '*' for "
                   "any): needed behind a reverse proxy or for a LAN name. Others get 403 (DNS rebinding).")
@click.option("--shutdown-grace", type=click.FloatRange(0), default=5, show_default=True,
              help="Seconds the running generation gets to finish after SIGTERM/Ctrl-C (queued ones get 503 at once).")
@click.option("--log-prompts", is_flag=True, help="Log prompt and completion text (never logged otherwise).")
@click.option("--no-webui", is_flag=True, help="Do not serve the chat page at /.")
@click.pass_context
@friendly_errors
def serve(ctx: click.Context, host: str, port: int, model_name: str | None, api_key: str | None,
          api_key_file: str | None, parallel: int, max_queue: int, max_body: int, max_tokens_limit: int | None,
          time_limit: float, cors_origins: tuple[str, ...], allowed_hosts: tuple[str, ...], shutdown_grace: float,
          log_prompts: bool, no_webui: bool, **kw) -> None:
    """Serve an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models
    (plus /health, /metrics, the docs at /docs and a chat page at /)."""
    api_key = resolve_api_key(ctx, api_key, api_key_file)
    for origin in cors_origins:
        if origin not in ("*", "null") and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#\s]+/?", origin, re.I):
            raise UserError(f"--cors-origin {origin!r}: give an origin such as http://localhost:3000 (scheme, host and "
                            "port, no path), '*' or 'null'")
    for name in allowed_hosts:
        if name != "*" and not re.fullmatch(r"(\*\.)?[^/:\s*]+(:\d+)?|\[[0-9a-f:.]+\](:\d+)?", name, re.I):
            raise UserError(f"--allowed-host {name!r}: give a host name such as example.com or '*.example.com' "
                            "(no scheme or path), or '*'")
    if api_key is None and not _is_loopback(host):
        progress(f"warning: listening on {host} without an API key: anyone who can reach this machine can use the "
                 f"server; set ${API_KEY_ENV} or --api-key-file")
    from localspec.server.app import run_server, served_names  # after the checks above: they fail fast

    name, aliases = served_names(kw["pair"], kw["oracle"], model_name)
    with open_engine(**kw, parallel=parallel) as engine:
        kv = sum(ctx.kv_bytes() for ctx in engine.contexts)
        progress(f"{engine.n_slots} slot{'s' if engine.n_slots != 1 else ''} (requests generated at once), "
                 f"{engine.n_ctx} tokens of context each; KV cache {kv / 2**20:.0f} MiB "
                 f"({' + '.join(f'{c.kv_bytes() / 2**20:.0f}' for c in engine.contexts)} MiB: the oracle's"
                 f"{', the draft' + chr(39) + 's' if engine.draft_ctx is not None else ''})")
        run_server(engine, host=host, port=port, grace=shutdown_grace, model_name=name, aliases=aliases,
                   api_key=api_key, max_queue=max_queue, max_body=max_body, max_tokens_limit=max_tokens_limit,
                   time_limit=time_limit or None, cors_origins=cors_origins, allowed_hosts=allowed_hosts,
                   log_prompts=log_prompts, webui=not no_webui)


@main.command()
@click.option("--pair", default=None, help="Model pair from models.toml (default: the default pair).")
@click.option("--oracle", default=None, help="Oracle model: a name from models.toml or a GGUF path.")
@click.option("--draft", default=None, help="Draft model: a name or a GGUF path.")
@click.option("--workload", default=None, help="Comma-separated workloads: chat,grounded,code,long (default: all) "
              "or paths to .jsonl files; with --clients: open (the default: open-ended prompts), records (32 product "
              "listings in one answer format, run twice on the same server) and agent (agent loops: a tool list, "
              "tool calls and results over 4 turns).")
@click.option("--systems", default=None, help="Comma-separated systems (default: baseline,k4,k8,k16,adaptive,"
              "model,lookup,llama.cpp-grid,llama.cpp-ngram,llama.cpp-ngram-fa-off,lcp-lookup; also kN, lookup-kN, hybrid, "
              "llama.cpp-kN, llama.cpp-spec, llama.cpp-ngram-kN, lcp-lookup-kN; any name but the baseline and lcp-lookup "
              "takes -fa-auto|-fa-on|-fa-off; llama.cpp-grid is llama.cpp-k4/k8/k16, each with -fa auto and off).")
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True, help="Interleaved repetitions.")
@click.option("--temperature", type=click.FloatRange(0.0, 2.0), default=0.0, show_default=True,
              help="Sample every timed run at this temperature (unseeded, no other filter), localspec's systems and "
                   "llama.cpp's alike; 0: greedy. Sampled runs have no greedy match, and llama-cpp-python's systems "
                   "(greedy only) are skipped. Not with --clients.")
@click.option("--max-prompts", type=click.IntRange(1), default=None, help="At most N prompts per workload (with "
              "--clients: N listings of records).")
@OPTIONS["max_tokens"].click_option(default=None, help="Cap every prompt's max_tokens.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="CPU threads, the same for every system (default: all cores).")
@click.option("--ctx", "n_ctx", type=click.IntRange(64, 1 << 20), default=4096, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full report.")
@click.option("--charts", "charts_dir", type=click.Path(file_okay=False), default=None,
              help="Write PNG charts here (needs matplotlib: pip install 'localspec[bench]').")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              help="Write a results document (machine, setup, table, charts).")
@click.option("--anchor-bin", type=click.Path(file_okay=False), default=None,
              help="Directory of llama.cpp's built speculative programs (default: scripts/build_llama_anchor.sh's).")
@click.option("--base-tree", type=click.Path(file_okay=False, exists=True), default=None,
              help="With --clients: a localspec checkout (a git worktree of an earlier commit, say) served as the "
                   "system localspec-base, beside this one in the same run.")
@click.option("--cross-tokenizer", is_flag=True, help="The draft's vocabulary differs from the oracle's: draft "
              "through text (set by pairs that need it).")
@click.option("--paired", is_flag=True, help="Also run every prompt of each localspec drafting system with drafting "
              "off, in the same process, and report that ratio too (the fairest test of a few percent; twice the time).")
@click.option("--clients", default=None, metavar="N,N,...",
              help="Serving benchmark instead: for each N, N clients at once stream greedy answers from `localspec "
                   "serve --parallel N` and llama.cpp's llama-server -np N (with its speculative types), a fresh "
                   "server per repetition; aggregate tokens/s, time to first token, tokens/s per request, draft "
                   "tokens accepted, and llama-batched-bench's plain batched decoding (--workload open,records,agent; "
                   "--systems, default all: localspec, localspec-no-suffix, localspec-no-prompt-cache, localspec-no-caches, "
                   "localspec-no-draft, localspec-base (with --base-tree), llama-server, "
                   "llama-server-draft, llama-server-ngram-mod, llama-server-ngram-cache, "
                   "llama-server-ngram-mod-draft, llama-server-ngram-cache-draft; when named: "
                   "localspec-no-draft-1-thread, llama.cpp's CPU threads at one).")
@click.option("--mixed-warmup", type=click.IntRange(0), default=12, show_default=True,
              help="Sampled requests (temperature 1.0 and 0.7, 48 tokens) each drafting localspec system answers "
              "before the greedy runs, as a server answering OpenAI clients does; 0: none.")
@click.option("--one-shot", is_flag=True, help="Also time each localspec system as a fresh `localspec generate` "
              "process per prompt (every repetition; the median is reported): start-up, model loading and prompt "
              "included, as a script sees it.")
@friendly_errors
def bench(**kw) -> None:
    """Speed at unchanged output: the oracle alone, localspec's systems, the ceiling and llama.cpp's own
    speculative decoding, side by side in one run. Prints a markdown table."""
    from localspec.bench.command import run
    from localspec.bench.runner import BenchError

    try:
        run(**kw, progress=progress, echo=click.echo)
    except (BenchError, ValueError) as e:
        raise UserError(str(e)) from e
