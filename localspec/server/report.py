"""localspec's report on speculation, for a request that asks (`"speculative": {"sources": true}`):
each choice's text cut at its tokens, each piece with where its token came from, and with the
choice's last chunk the figures `localspec chat`'s /stats shows (schemas.SpeculationReport). The
engine labels the text as it releases it (`Chunk.sources`); this turns that into the wire format.
A request that does not ask gets none of it, and the engine keeps nothing for it."""

from __future__ import annotations

from typing import Any

from localspec.speculative.costs import estimated_speedup
from localspec.outputs import Chunk, Stats
from localspec.server import schemas as S


def asked(body: Any) -> bool:
    """Whether the request (chat or completion) asked for the report."""
    spec = body.speculative
    return isinstance(spec, S.Speculative) and spec.sources


def sources(chunk: Chunk) -> S.SpeculationReport:
    """A streamed chunk's report: the pieces of its text."""
    return S.SpeculationReport(sources=chunk.sources or [])


def last(chunk: Chunk, *, text: bool = True) -> S.SpeculationReport:
    """The report of a choice's last chunk (or of the whole choice, when `chunk` holds its whole
    text's sources): its pieces (`text`: the chunk carries its text) and the reply's figures."""
    return S.SpeculationReport(sources=(chunk.sources or []) if text else [], figures=figures(chunk.stats))


def figures(stats: Stats | None) -> S.ReplyFigures | None:
    if stats is None:
        return None
    return S.ReplyFigures(
        completion_tokens=stats.completion_tokens, steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
        lookup_accepted=stats.lookup_accepted, suffix_accepted=stats.suffix_accepted,
        acceptance_rate=round(stats.acceptance_rate, 4) if stats.drafted else None,
        mean_accepted_length=round(stats.mean_accepted_length, 3),
        tokens_per_second=round(stats.tokens_per_second, 2), speedup=_rounded(estimated_speedup(stats)))


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
