"""Constrained decoding on scripted models (no llama.cpp): the grammar's masks, and exactness of the
speculative loop under them (greedy output is the constrained oracle alone's; sampled output is
distributed as the constrained oracle's)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from localspec.constraints import Constraint, ConstraintError, ConstraintWalk, bounded_schema, tokenizer_for
from localspec.runtime.engine import Request
from localspec.speculative.policy import FixedLength
from localspec.speculative.sampling import SamplingParams, mask_logits
from scripted import EOS
from test_engine_scripted import (KINDS, N_SAMPLES, PROMPT, chi_square, first_tokens_distribution,  # noqa: F401
                                  fixed_entropy, outcome_probability, proposer_engine, sample_first_tokens)

# a tiny grammar: 2 to 6 letters or spaces, then a full stop (then only the end)
GRAMMAR = 'start: /[a-z ]{2,6}/ "."'
LETTERS = re.compile(r"[a-z ]*")


def expected_mask(model, generated: list[int]) -> np.ndarray:
    """The grammar's mask after `generated`, worked out by hand from the token texts (independent of
    llguidance): a token is allowed when the text stays a prefix of the language; EOS once complete,
    and after it."""
    text = b"".join(model.token_piece(t) for t in generated).decode()
    complete = text.endswith(".") or EOS in generated
    mask = np.zeros(model.n_vocab, dtype=bool)
    if complete:
        mask[EOS] = True
        return mask
    for t in range(model.n_vocab):
        piece = model.token_piece(t)
        if not piece or t == EOS:
            continue
        try:
            s = text + piece.decode()
        except UnicodeDecodeError:
            continue
        body, dot, rest = s.partition(".")
        ok = LETTERS.fullmatch(body) is not None and len(body) <= 6 and (not dot or (len(body) >= 2 and not rest))
        mask[t] = ok
    return mask


def constrained(logits, model, n_prompt: int):
    """The constrained oracle's logits: the oracle's, masked by the grammar after the generated part."""
    def at(history):
        return mask_logits(logits(history), expected_mask(model, list(history[n_prompt:])))
    return at


def test_masks_follow_the_grammar_and_roll_back():
    """Random walks through the grammar with rollbacks, the end of the generation and what a draft
    pushes after it included (a rolled-back end once left llguidance's length count wrong)."""
    engine = proposer_engine("draft40")
    model = engine.oracle_model
    walk = ConstraintWalk.of(engine.oracle_model, Constraint.from_grammar(GRAMMAR))
    rng = np.random.default_rng(0)
    generated: list[int] = []
    ends = 0
    for _ in range(600):
        allowed, expected = walk.allowed(), expected_mask(model, generated)
        np.testing.assert_array_equal(allowed, expected)
        assert walk.depth == len(generated) and walk.complete == expected[EOS]
        if rng.random() < 0.3 and generated:
            n = int(rng.integers(1, len(generated) + 1))
            walk.pop(n)
            del generated[-n:]
            continue
        token = int(rng.choice(np.flatnonzero(allowed)))
        ends += token == EOS
        walk.push(token)
        generated.append(token)
    assert walk.seconds > 0 and ends > 20


def test_extend_cuts_a_model_free_draft_where_the_grammar_refuses():
    engine = proposer_engine("lookup")
    model = engine.oracle_model
    walk = ConstraintWalk.of(engine.oracle_model, Constraint.from_grammar(GRAMMAR))
    tokens = model.tokenize("ab,cd", add_special=False)
    assert walk.extend(tokens) == 2 and walk.depth == 2


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_constrained_output_is_the_constrained_oracle_alones(kind):
    engine, alone = proposer_engine(kind), proposer_engine(kind)
    alone.policy = FixedLength(0)
    prompt = engine.oracle_model.tokenize(PROMPT)
    want = constrained(engine.oracle.logits, engine.oracle_model, len(prompt))
    history = list(prompt)
    for _ in range(8):  # the constrained oracle's own greedy text, by hand
        token = int(np.argmax(want(tuple(history))))
        if token == EOS:
            break
        history.append(token)
    for options in [{}, *({"temperature": 1.0, "seed": seed} for seed in range(5))]:
        request = Request(max_tokens=20, sampling=SamplingParams(**options),
                          constraint=Constraint.from_grammar(GRAMMAR))
        spec = [t for c in engine.stream_tokens(prompt, request) for t in c.tokens]
        assert spec == [t for c in alone.stream_tokens(prompt, request) for t in c.tokens]
        if not options:
            assert spec == history[len(prompt):]
        assert re.fullmatch(r"[a-z ]{2,6}\.", engine.oracle_model.detokenize(spec))


FILTERED = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)


@pytest.mark.parametrize("kind, sampling", [("draft40", SamplingParams(temperature=1.0)), ("draft44", FILTERED),
                                            ("lookup", SamplingParams(temperature=1.0)),
                                            ("hybrid", SamplingParams(temperature=1.0)),
                                            ("cross-tokenizer", SamplingParams(temperature=1.0))])
def test_sampled_constrained_output_follows_the_constrained_oracle(kind, sampling, fixed_entropy):
    """The speculative sampler under the grammar (draft drafting under the mask, masked verification,
    rollback) against the exact distribution of the constrained oracle alone: a chi-square test."""
    engine = proposer_engine(kind)
    prompt = engine.oracle_model.tokenize(PROMPT)
    want = constrained(engine.oracle.logits, engine.oracle_model, len(prompt))
    expected = first_tokens_distribution(want, prompt, sampling)
    counts, drafted, accepted = sample_first_tokens(engine, prompt, sampling, N_SAMPLES,
                                                    constraint=Constraint.from_grammar(GRAMMAR))
    for outcome in counts:  # nothing the constrained oracle could not have sampled
        assert outcome_probability(want, prompt, sampling, outcome) > 0, outcome
    stat, critical = chi_square(counts, expected, N_SAMPLES)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both paths ran


def test_the_constrained_test_tells_the_unconstrained_oracle_apart():
    """Power: the oracle without the mask is far from the constrained one at N_SAMPLES."""
    sampling = SamplingParams(temperature=1.0)
    engine = proposer_engine("draft40")
    prompt = engine.oracle_model.tokenize(PROMPT)
    want = constrained(engine.oracle.logits, engine.oracle_model, len(prompt))
    expected = first_tokens_distribution(want, prompt, sampling)
    free = first_tokens_distribution(engine.oracle.logits, prompt, sampling)
    mean_counts = {o: N_SAMPLES * p for o, p in free.items()}
    noncentrality, critical = chi_square(mean_counts, expected, N_SAMPLES)
    assert noncentrality > 3 * critical


# --- schemas ---------------------------------------------------------------------------------------


def test_bounded_schema_bounds_numbers_and_closes_named_objects():
    person = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0},
        "height": {"type": ["number", "null"]},
        "ratio": {"type": "number", "multipleOf": 0.5, "maximum": 1},
        "tags": {"type": "array"},
        "extra": {"description": "anything"}}}
    before = json.dumps(person)
    out = bounded_schema(person)
    assert json.dumps(person) == before  # the schema given is not changed
    props = out["properties"]
    assert props["age"] == {"type": "integer", "minimum": 0, "maximum": 10 ** 16 - 1}  # its own bound kept
    assert props["height"]["exclusiveMinimum"] == -1e16 and props["height"]["exclusiveMaximum"] == 1e16
    assert props["height"]["multipleOf"] == 1e-10
    assert props["ratio"]["multipleOf"] == 0.5 and props["ratio"]["maximum"] == 1 and "exclusiveMaximum" not in props["ratio"]
    assert props["tags"]["items"] == props["extra"] == {"$ref": "#/$defs/localspec_any_value"}
    assert out["additionalProperties"] is False  # it names its properties: only those
    any_value = out["$defs"]["localspec_any_value"]["anyOf"]
    assert {"type": "number", "exclusiveMinimum": -1e16, "exclusiveMaximum": 1e16, "multipleOf": 1e-10} in any_value
    # JSON mode: an object of any values, numbers bounded; a schema that says it is open stays open
    assert bounded_schema({"type": "object"})["additionalProperties"] == {"$ref": "#/$defs/localspec_any_value"}
    assert bounded_schema({"properties": {}, "additionalProperties": True})["additionalProperties"] == \
        {"$ref": "#/$defs/localspec_any_value"}
    assert bounded_schema(True) == bounded_schema({}) == {"anyOf": any_value, "$defs": out["$defs"]}


def test_invalid_schemas_and_grammars_say_what_is_wrong():
    with pytest.raises(ConstraintError, match="Invalid type: foo"):
        Constraint.json_schema({"type": "foo"})
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ConstraintError, match="must be a JSON object"):
        Constraint.json_schema([1])
    with pytest.raises(ConstraintError, match="invalid Lark grammar.*unknown name"):
        Constraint.from_grammar("start: foo")
    with pytest.raises(ConstraintError, match="GBNF"):
        Constraint.from_grammar('root ::= ( "yes" ')
    with pytest.raises(ConstraintError, match="empty"):
        Constraint.from_grammar("  ")
    assert Constraint.from_grammar('root ::= "yes" | "no"').kind == "gbnf"


def test_max_tokens_in_the_middle_is_length_and_incomplete():
    engine = proposer_engine("draft40")
    r = engine.generate(PROMPT, max_tokens=1, grammar=GRAMMAR)
    assert r.finish_reason == "length" and r.structure == "incomplete"
    r = engine.generate(PROMPT, max_tokens=30, grammar=GRAMMAR)
    assert r.finish_reason == "stop" and r.structure == "complete" and r.text.endswith(".")
    # max_tokens reached just as the text is complete: nothing but the end could follow, so it stopped
    exact = engine.generate(PROMPT, max_tokens=len(r.tokens), grammar=GRAMMAR)
    assert (exact.text, exact.finish_reason, exact.structure) == (r.text, "stop", "complete")


def test_tokenizer_is_built_once_per_model():
    engine = proposer_engine("draft40")
    assert tokenizer_for(engine.oracle_model) is tokenizer_for(engine.oracle_model)
    assert json.loads(Constraint.json_object().grammar)


def test_a_forced_run_is_drafted_without_the_model():
    """Where the grammar allows one token only, the draft proposes it without a pass of its own: the
    run is read in one batch with the token before it (here everything after the first letter is forced)."""
    engine = proposer_engine("draft40")
    proposer = engine.proposer
    model = engine.oracle_model
    walk = ConstraintWalk.of(engine.oracle_model, Constraint.from_grammar('start: /[ab]/ "cdefg" /[ab]/ "hij"'))
    history = model.tokenize(PROMPT)
    proposer.start(catch_up=True)
    draft = proposer.propose(history, 10, SamplingParams(), np.random.default_rng(0), constraint=walk)
    text = model.detokenize(draft.tokens.tolist())
    assert re.fullmatch(r"[ab]cdefg[ab]hij", text[:10]) and walk.depth == len(draft)
    # one pass over the prompt, one batch of [first letter, c, d, e, f, g], then the rest is forced again
    assert draft.evaluated == len(history) + 6
