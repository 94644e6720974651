"""Structured output: the token masks of a JSON schema or a grammar, from llguidance.

llguidance (Microsoft's low-level grammar engine behind Guidance, a Rust library with no Python
dependencies) compiles a JSON schema, a Lark grammar or a GBNF grammar against the model's vocabulary
and tells, at each position, which tokens keep the text inside the grammar (a bitmask over the
vocabulary, ~0.03 ms per token on SmolLM2's 49152 tokens); it rolls back by n tokens, which is what a
rejected draft needs.

* `Constraint`: what a request asks for (a compiled-to-text llguidance grammar), validated up front:
  an invalid schema or grammar is a `ConstraintError` (a ValueError) naming what is wrong, before
  anything is generated.
* `ConstraintWalk`: one generation's matcher. It holds every token emitted so far; the draft pushes
  its tokens as it proposes them (so it only proposes allowed tokens), the verifier reads the masks
  at the k+1 verified positions from the same walk (a mask is a function of the token prefix alone,
  so each position's mask is computed once), and the engine pops back to the accepted prefix.

Nothing here touches logits: `allowed()` is a boolean array over the vocabulary, applied with
`sampling.mask_logits`.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLTokenizer

# llguidance is imported where it is used, not here: the engine imports this module, and a
# request without a schema or grammar (most of them) should not pay ~30 ms of every process's start

# JSON is generated in one canonical layout: `{"a": 1, "b": [2, 3]}`. Without flexible whitespace a
# small model cannot fill the output with newlines until max_tokens, and more of the text is forced
# (the draft and the oracle agree on it for free).
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
GRAMMAR_SYNTAXES = ("auto", "lark", "gbnf", "regex")

# Numbers are bounded too, or a small model writes `"population": 1111111111...` until max_tokens:
# at most 16 digits before the point (as llama.cpp's JSON-schema grammars) and 10 after it (llguidance
# takes a `multipleOf` of at most 10 decimals; llama.cpp allows 16), no exponent. A schema's own
# bounds or multipleOf win. Values a schema leaves open (`{}`, an array without `items`, an object
# without `properties`, JSON mode) are any JSON value with numbers so bounded; an object that names
# its properties gets only those unless it says otherwise with additionalProperties.
INTEGRAL_DIGITS = 16
FRACTION_DIGITS = 10
_ANY_NAME = "localspec_any_value"
_ANY_REF = f"#/$defs/{_ANY_NAME}"
_INTEGER_BOUNDS = {"minimum": -(10 ** INTEGRAL_DIGITS - 1), "maximum": 10 ** INTEGRAL_DIGITS - 1}
_NUMBER_BOUNDS = {"exclusiveMinimum": -float(10 ** INTEGRAL_DIGITS), "exclusiveMaximum": float(10 ** INTEGRAL_DIGITS)}
_ANY_VALUE = {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, {"type": "string"},
    {"type": "number", **_NUMBER_BOUNDS, "multipleOf": float(f"1e-{FRACTION_DIGITS}")},  # integers included
    {"type": "array", "items": {"$ref": _ANY_REF}},
    {"type": "object", "additionalProperties": {"$ref": _ANY_REF}},
]}
# the keywords that say something about a value's shape; a schema with none of them accepts anything
_SHAPE_KEYWORDS = {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties", "items",
                   "prefixItems", "additionalProperties", "patternProperties", "required", "if", "minimum",
                   "maximum", "pattern", "format", "minLength", "maxLength"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains")


def bounded_schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """`schema` with every number bounded and every open value an any-JSON-value with bounded
    numbers (see INTEGRAL_DIGITS): what a small model cannot loop in. A new dict; the schema given
    is not changed."""
    used = [False]
    out = _bounded(schema, used, root=True)
    if out == {"$ref": _ANY_REF}:
        out = dict(_ANY_VALUE)
    if used[0]:
        out = {**out, "$defs": {**out.get("$defs", {}), _ANY_NAME: _ANY_VALUE}}
    return out


def _bounded(node: Any, used: list[bool], root: bool = False) -> Any:
    if node is True or (isinstance(node, dict) and not node.keys() & _SHAPE_KEYWORDS
                        and not (root and node.keys() & {"$defs", "definitions"})):
        used[0] = True
        return {"$ref": _ANY_REF}
    if not isinstance(node, dict):
        return node  # false, or something llguidance will refuse with its own message
    out = dict(node)
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "integer" in types:
        for side, bound in _INTEGER_BOUNDS.items():
            if side not in node and "exclusive" + side.capitalize() not in node:
                out[side] = bound
    if "number" in types:
        for side, bound in _NUMBER_BOUNDS.items():
            if side not in node and side.removeprefix("exclusive").lower() not in node:
                out[side] = bound
        out.setdefault("multipleOf", float(f"1e-{FRACTION_DIGITS}"))
    if "additionalProperties" not in node and "patternProperties" not in node:
        if "properties" in node:  # only the properties it names, as llama.cpp's grammars do: the output is
            out["additionalProperties"] = False  # valid either way, and a small model invents keys to max_tokens
        elif "object" in types:
            out["additionalProperties"] = True  # open: any value, bounded below
    if "array" in types and "items" not in node and "prefixItems" not in node:
        out["items"] = True
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _bounded(sub, used) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bounded(sub, used) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out and (isinstance(out[key], dict) or out[key] is True):
            out[key] = _bounded(out[key], used)
    return out


class ConstraintError(ValueError):
    """A schema or grammar that is invalid, or that llguidance cannot compile."""


@dataclass(frozen=True)
class Constraint:
    """A validated llguidance grammar (its JSON text) and what it came from, for messages."""

    grammar: str
    kind: str  # "json_schema", "json_object", "lark", "gbnf", "regex"

    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        """A JSON schema: a dict (or true / false), its JSON text, or a pydantic model class."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        schema = bounded_schema(schema)
        from llguidance import LLMatcher

        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"invalid JSON schema: {e}") from None
        return cls._checked(grammar, "json_schema", "invalid JSON schema")

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def from_grammar(cls, text: str, syntax: str = "auto") -> "Constraint":
        """A grammar in llguidance's Lark syntax, llama.cpp's GBNF, or a regular expression.
        "auto": GBNF when the text has a `::=` rule, else Lark."""
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("the grammar is empty")
        if syntax not in GRAMMAR_SYNTAXES:
            raise ConstraintError(f"unknown grammar syntax {syntax!r} (expected one of {', '.join(GRAMMAR_SYNTAXES)})")
        if syntax == "auto":
            syntax = "gbnf" if "::=" in text else "lark"
        import llguidance

        if syntax == "regex":
            return cls._checked(llguidance.LLMatcher.grammar_from_regex(text), "regex", "invalid regular expression")
        try:
            grammar = llguidance.grammar_from(syntax, text)
        except ValueError as e:
            raise ConstraintError(f"invalid {syntax.upper() if syntax == 'gbnf' else 'Lark'} grammar: {e}") from None
        return cls._checked(grammar, syntax, f"invalid {'GBNF' if syntax == 'gbnf' else 'Lark'} grammar")

    @classmethod
    def _checked(cls, grammar: str, kind: str, what: str) -> "Constraint":
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ConstraintError(f"{what}: {error.strip()}")
        return cls(grammar, kind)


# ---------------------------------------------------------------- the vocabulary

_tokenizers: "weakref.WeakKeyDictionary[Any, LLTokenizer]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def tokenizer_for(model) -> LLTokenizer:
    """llguidance's view of `model`'s vocabulary (built once per model, ~0.4 s at 49k tokens): each
    token's bytes from the GGUF, control tokens marked as such, every end-of-generation token as EOS."""
    with _tokenizers_lock:
        tok = _tokenizers.get(model)
        if tok is None:
            tok = _tokenizers[model] = _build_tokenizer(model)
        return tok


def _build_tokenizer(model) -> LLTokenizer:
    import llguidance

    eog = [t for t in range(model.n_vocab) if model.is_eog(t)] or [model.eos]
    vocab = getattr(model, "_vocab", None)
    if vocab is not None:  # a llama.cpp model: llguidance tokenizes through llama.cpp itself
        return _llama_tokenizer(model, vocab, eog)
    # anything else with LlamaModel's vocabulary interface (the tests' scripted models)
    special = sorted({model.bos, *eog})

    class _Vocabulary:
        eos_token_id = eog[0]
        bos_token_id = model.bos
        special_token_ids = special
        tokens = [(b"\xff" if t in special else b"") + model.token_piece(t, special=True)
                  for t in range(model.n_vocab)]

        def __call__(self, text):
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return model.tokenize(text, add_special=False, parse_special=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=model.n_vocab, eos_token=eog)


def _llama_tokenizer(model, vocab, eog: list[int]) -> LLTokenizer:
    """As llguidance.llamacpp.lltokenizer_from_vocab (which calls a llama.cpp function deprecated in the
    installed version once per token): each token's bytes, control tokens (and user-defined ones that
    look like them) prefixed with 0xFF as llguidance marks special tokens, llama_tokenize for text."""
    import ctypes

    from llguidance import LLTokenizer

    from localspec.llama.bindings import llama_cpp

    tokens = []
    for t in range(model.n_vocab):
        piece = model.token_piece(t, special=True)
        attr = llama_cpp.llama_vocab_get_attr(vocab, t)
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (
                attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    tokenize = ctypes.cast(llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=eog, slices=None)


# ---------------------------------------------------------------- one generation's walk


class ConstraintWalk:
    """The matcher of one constrained generation, and the masks it computed.

    `depth` tokens have been pushed since the generation began (emitted ones, then any draft tokens
    of the current step). `allowed()` is the mask after them; masks at the depths of the current
    step are kept until `settle()`, so the verifier reuses the draft's. `seconds`: time spent in
    llguidance (masks and matcher updates)."""

    def __init__(self, tokenizer: LLTokenizer, constraint: Constraint, n_vocab: int) -> None:
        self.constraint = constraint
        self.n_vocab = n_vocab
        from llguidance import LLMatcher

        self._matcher = LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"cannot compile the {constraint.kind.replace('_', ' ')}: "
                                  f"{self._matcher.get_error().strip()}")
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # llguidance writes the bitmask here
        self._masks: dict[int, np.ndarray] = {}  # depth -> bool [n_vocab]
        self._eos = frozenset(int(t) for t in tokenizer.eos_tokens)
        self._ended_at: int | None = None  # the depth an end-of-generation token was pushed at
        self._end_mask: np.ndarray | None = None  # bool [n_vocab]: after the end, only the end again
        self.depth = 0
        self.seconds = 0.0

    @classmethod
    def of(cls, model, constraint: Constraint) -> "ConstraintWalk":
        """A walk for one generation under `constraint` over `model`'s vocabulary. Raises
        ConstraintError when llguidance cannot compile it (the vocabulary is read on first use)."""
        return cls(tokenizer_for(model), constraint, model.n_vocab)

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens that may come next (read-only; EOS only once complete)."""
        if self._ended_at is not None:
            return self._after_end()
        mask = self._masks.get(self.depth)
        if mask is None:
            t0 = time.perf_counter()
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)
            mask.flags.writeable = False
            self._check()
            self._masks[self.depth] = mask
            self.seconds += time.perf_counter() - t0
        return mask

    def forced(self) -> int | None:
        """The one token the grammar allows next, if only one is (None otherwise)."""
        allowed = np.flatnonzero(self.allowed())
        return int(allowed[0]) if allowed.size == 1 else None

    def push(self, token: int) -> None:
        """Advance over `token`, which must be allowed (a bug otherwise: nothing masked proposes it).

        An end-of-generation token is not given to llguidance: rolling a matcher back over a
        consumed EOS leaves its lexer wrong (llguidance 1.9.1: after a draft of `"]`, `}`, EOS was
        rejected, a string went on past its maxLength). The walk marks the end itself (it was
        allowed, so the text was a whole instance), and anything after it is the end again."""
        if self._ended_at is not None or token in self._eos:
            if self._ended_at is None:
                if not self.allowed()[token]:
                    raise RuntimeError(f"token {token} (the end) is not allowed here: the text is incomplete")
                self._ended_at = self.depth
            self.depth += 1
            return
        t0 = time.perf_counter()
        ok = self._matcher.consume_token(int(token))
        self.seconds += time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"token {token} is not allowed here: {self._matcher.get_error()}")
        self.depth += 1

    def extend(self, tokens) -> int:
        """Push the longest allowed prefix of `tokens`; how many were pushed (a model-free draft is
        cut where the grammar would refuse it)."""
        n = 0
        for token in tokens:
            if not self.allowed()[token]:
                break
            self.push(token)
            n += 1
        return n

    def pop(self, n: int) -> None:
        """Forget the last n pushed tokens (rejected draft tokens)."""
        if n <= 0:
            return
        if n > self.depth:
            raise ValueError(f"cannot roll back {n} tokens of {self.depth}")
        consumed = n
        if self._ended_at is not None:  # the end and what followed it never reached llguidance
            consumed = max(0, n - (self.depth - self._ended_at))
            if self.depth - n <= self._ended_at:
                self._ended_at = None
        t0 = time.perf_counter()
        if consumed and not self._matcher.rollback(consumed):
            raise RuntimeError(f"llguidance could not roll back {consumed} tokens: {self._matcher.get_error()}")
        self.seconds += time.perf_counter() - t0
        for d in range(self.depth - n + 1, self.depth + 1):
            self._masks.pop(d, None)
        self.depth -= n

    def masks(self, start: int) -> np.ndarray:
        """bool [depth - start + 1, n_vocab]: the masks after `start`, `start + 1`, ... `depth` tokens
        (the verified positions of a step that began at `start`)."""
        self.allowed()
        return np.stack([self._mask_at(d) for d in range(start, self.depth + 1)])  # every one was needed to push

    def _mask_at(self, depth: int) -> np.ndarray:
        if self._ended_at is not None and depth > self._ended_at:
            return self._after_end()
        return self._masks[depth]

    def _after_end(self) -> np.ndarray:
        if self._end_mask is None:
            mask = np.zeros(self.n_vocab, dtype=bool)
            mask[[t for t in self._eos if t < self.n_vocab]] = True
            mask.flags.writeable = False
            self._end_mask = mask
        return self._end_mask

    def settle(self) -> None:
        """The step is over: drop the masks of earlier positions (only the current one is kept)."""
        current = self._masks.get(self.depth)
        self._masks.clear()
        if current is not None:
            self._masks[self.depth] = current

    @property
    def complete(self) -> bool:
        """Only the end of the generation can follow: the text is a whole instance of the grammar
        (or the end was pushed: it is allowed only then)."""
        return self._ended_at is not None or (self._matcher.is_stopped() and self._matcher.is_accepting())

    @property
    def accepting(self) -> bool:
        """The text so far is a whole instance of the grammar (more may still follow)."""
        return self._ended_at is not None or self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance: {self._matcher.get_error()}")
