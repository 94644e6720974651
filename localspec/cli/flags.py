"""The options several `localspec` commands share (which models and how, sampling, structure) and
what they come to: the request's `GenerationOptions`, the loaded `Engine`, a context that fits."""

from __future__ import annotations

from typing import Any, Callable

import click

from localspec.cli.console import UserError, progress
from localspec.options import DEFAULT_CTX, DEFAULT_PROMPT_CACHE_MIB, DEFAULT_SUFFIX_CACHE, OPTIONS, GenerationOptions, OptionError


CTX_STEP = 256
# requests generated at once by default: serve (a chat UI and an agent at once, a few people on one
# workstation; llama-server's own default) and a batch file (records of one job: more throughput
# per pass than a person waiting on one reply would trade for)
DEFAULT_SERVE_PARALLEL = 4
DEFAULT_BATCH_PARALLEL = 8
# tokens a chat template (its special tokens, role names, a default system message) may add around
# the messages' own text
TEMPLATE_ALLOWANCE = 256


def fitted_context(texts: list[str], max_tokens: int) -> int:
    """A context size that holds one request, at most DEFAULT_CTX: its text is at most a token per
    UTF-8 byte (every byte-level BPE or byte-fallback vocabulary), plus what a chat template adds,
    plus the answer, rounded up. A fresh process then creates (and llama.cpp zeroes) a KV cache the
    size of its job rather than DEFAULT_CTX's: measured, a 162-token prompt with a 256-token answer
    starts and runs ~0.1 s sooner in a 1024-token context than in a 4096-token one (AMD EPYC Zen 4,
    SmolLM2-135M F32 oracle and Q4_1 draft)."""
    need = sum(len(t.encode("utf-8")) for t in texts) + TEMPLATE_ALLOWANCE + max_tokens
    return min(DEFAULT_CTX, -(-need // CTX_STEP) * CTX_STEP)


FLASH_ATTN_OPTION = click.option(
    "--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
    help="Flash attention for both models. auto: what `localspec check` measured faster here, else off on a "
         "CPU (a multi-token pass then stays flat as the context grows) and on with GPU offload.")


def _rpc_servers(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    from localspec.llama.rpc import parse_servers

    try:
        return parse_servers(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


RPC_OPTIONS = (
    click.option("--rpc", metavar="HOST:PORT[,HOST:PORT...]", callback=_rpc_servers, default=None,
                 help="Split the oracle's layers over llama.cpp rpc-servers and this machine (needs llama.cpp built "
                      "with RPC: scripts/build_rpc.sh). rpc-server has no authentication and runs what it is sent: "
                      "run it on loopback or a trusted network only."),
    click.option("--draft-rpc", metavar="HOST:PORT[,HOST:PORT...]", callback=_rpc_servers, default=None,
                 help="The same for the draft (default: it stays local, where its per-token cost is lowest)."),
)


def model_options(fn: Callable) -> Callable:
    """Which models to run and how: shared by generate, chat, serve, check and bench."""
    options = [
        click.option("--pair", default=None, help="Model pair from models.toml (default: the default pair)."),
        click.option("--oracle", default=None, help="Oracle model: a name from models.toml or a GGUF path."),
        click.option("--draft", default=None,
                     help="Draft model: a name or a GGUF path, or 'ngram' for prompt lookup (no model)."),
        click.option("--no-draft", is_flag=True, help="Run the oracle alone (the baseline)."),
        OPTIONS["draft_max"].click_option(
            help="Most tokens drafted per step (default 16 for a draft model; 64 for prompt lookup, whose "
                 "drafts are free)."),
        click.option("--draft-length", type=click.IntRange(0, 64), default=None,
                     help="Draft exactly this many tokens per step (default: adaptive, from measured costs)."),
        click.option("--p-min", type=click.FloatRange(0, 1), default=None,
                     help="The draft stops when its top probability falls below this."),
        click.option("--lookup/--no-lookup", default=True, show_default=True,
                     help="Prompt lookup beside the draft model: each step drafts from the text's own "
                          "repeats (free) or the model, whichever promises more; --no-lookup: the model alone."),
        click.option("--suffix-cache-tokens", "suffix_cache", type=click.IntRange(0, 1 << 31),
                     default=DEFAULT_SUFFIX_CACHE, show_default=True,
                     help="Tokens of earlier requests' text (prompts and answers) kept to draft from: a "
                          "request that repeats what earlier ones said is drafted for free. One cache per API "
                          "key (drafts change timing, never text, but timing could tell one client about "
                          "another's); about 28 MB a million tokens; 0: off."),
        click.option("--prompt-cache-mib", "prompt_cache_mib", type=click.IntRange(0, 1 << 24),
                     default=DEFAULT_PROMPT_CACHE_MIB, show_default=True,
                     help="Host memory (MiB) that keeps the oracle's cache of finished requests when a new "
                          "request takes their slot: a later prompt that starts the same way (the same request "
                          "again, an agent's next turn) is copied back, not evaluated. Filled as used, the least "
                          "recently used out first; one per API key; 0: off."),
        click.option("--cross-tokenizer", is_flag=True,
                     help="Allow a draft with a different vocabulary (text is re-tokenized between them)."),
        click.option("--gpu-layers", type=int, default=-1, show_default=True,
                     help="Oracle layers offloaded to the GPU or the --rpc servers, the last ones (-1: all, but "
                          "with --rpc and no GPU a share in proportion to free memory stays here; CPU builds "
                          "ignore it without --rpc)."),
        click.option("--draft-gpu-layers", type=int, default=-1, show_default=True,
                     help="Draft layers offloaded to the GPU (-1: all)."),
        click.option("--ctx", "n_ctx", type=click.IntRange(64, 1 << 20), default=None,
                     help=f"Context size in tokens (default {DEFAULT_CTX}; `generate` with one prompt: no more "
                          "than that prompt and --max-tokens can need)."),
        click.option("--threads", type=click.IntRange(1, 1024), default=None, help="CPU threads (default: all cores)."),
        FLASH_ATTN_OPTION,
        *RPC_OPTIONS,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")  # flags of generate and chat


def sampling_options(fn: Callable) -> Callable:
    """--max-tokens, --temperature, ...: each from its rule in localspec.options."""
    for name in reversed(SAMPLING):
        fn = OPTIONS[name].click_option()(fn)
    return fn


def structure_options(fn: Callable) -> Callable:
    """--json-schema / --grammar: files holding the option's schema or grammar."""
    return OPTIONS["schema"].click_option()(OPTIONS["grammar"].click_option()(fn))


def request_options(kw: dict[str, Any], json_schema: str | None = None,
                    grammar: str | None = None) -> GenerationOptions:
    """The command line's generation options, checked before any model loads (exit 2 naming the
    problem); --json-schema / --grammar are read and compiled here."""
    if json_schema is not None and grammar is not None:
        raise UserError("give --json-schema or --grammar, not both")
    structure: dict[str, Any] = {}
    path = json_schema or grammar
    if path is not None:
        with click.open_file(path, encoding="utf-8") as f:
            structure["schema" if json_schema is not None else "grammar"] = f.read()
    try:
        return GenerationOptions(**{name: kw[name] for name in SAMPLING}, **structure)
    except ValueError as e:
        raise UserError(f"{path}: {e}" if path is not None and not isinstance(e, OptionError) else str(e)) from None


def open_engine(*, pair, oracle, draft, no_draft, draft_max, draft_length, p_min, lookup, cross_tokenizer,
                gpu_layers, draft_gpu_layers, n_ctx, threads, flash_attn="auto",
                rpc=(), draft_rpc=(), parallel: int = 1, suffix_cache: int = DEFAULT_SUFFIX_CACHE,
                prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB, **_):
    """Resolve the models (fetching them on first use) and load them, with `parallel` slots."""
    from localspec.runtime.engine import DEFAULT_P_MIN, Engine
    from localspec.models import Registry

    choice = Registry.load().choose(pair, oracle, draft)
    draft = None if no_draft else choice.draft
    if draft is None and not no_draft:
        progress("no --draft given for this oracle: running it alone")
    return Engine(choice.oracle, draft, n_ctx=n_ctx or DEFAULT_CTX, n_threads=threads, gpu_layers=gpu_layers,
                  draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn, draft_length=draft_length,
                  draft_max=draft_max,
                  p_min=DEFAULT_P_MIN if p_min is None else p_min, lookup=lookup,
                  cross_tokenizer=cross_tokenizer or choice.cross_tokenizer, progress=progress, rpc=rpc,
                  draft_rpc=draft_rpc, parallel=parallel, suffix_cache=suffix_cache,
                  prompt_cache_mib=prompt_cache_mib)
