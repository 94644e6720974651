"""The request fields of the OpenAI surface against the real `localspec serve` (default pair) with the
official `openai` client: stream_options only with a stream, logit_bias (greedy output the biased
oracle's with and without speculation), echo with the prompt's logprobs, token-id prompts, and
llama-server's shapes (response_format with a schema beside the type, speculative.n_max/n_min/p_min)."""

from __future__ import annotations

import json

import openai
import pytest

from serving import cli_serve, wait_ready

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(pair_paths):
    with cli_serve("--ctx", "1024", "--draft-length", "4") as handle:
        with openai.OpenAI(base_url=wait_ready(handle) + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
def vocab(pair_paths):
    from localspec.llama.context import LlamaModel

    model = LlamaModel(pair_paths[0])
    yield model
    model.close()


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def test_stream_options_need_a_stream_on_both_endpoints(client):
    chat = _bad_request(lambda: client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        stream_options={"include_usage": True}))
    text = _bad_request(lambda: client.completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                                                          stream_options={"include_usage": True}))
    assert chat["param"] == text["param"] == "stream_options"
    chunks = list(client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def test_logit_bias_greedy_is_the_biased_oracles_with_and_without_speculation(client, vocab):
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
    favourite = vocab.tokenize(plain.choices[0].logprobs.tokens[0], add_special=False, parse_special=False)
    assert len(favourite) == 1
    bias = {str(favourite[0]): -100}
    texts = {}
    for speculative in (True, False):
        r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, logit_bias=bias,
                                      extra_body={"speculative": {"enabled": speculative}})
        texts[speculative] = r.choices[0].text
        assert (r.usage.drafted > 0) == speculative
    assert texts[True] == texts[False]  # speculation keeps the biased oracle's output
    assert not texts[True].startswith(plain.choices[0].logprobs.tokens[0])  # the favourite is banned
    assert texts[True] != plain.choices[0].text


def test_logit_bias_errors_name_the_field(client):
    for bias in ({"": 1}, {"5": 101}, {"99999999": 1}):  # a key that is not an id is text (tests/test_server.py)
        err = _bad_request(lambda: client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2,
                                                             logit_bias=bias))
        assert "logit_bias" in (err.get("param") or "") + err["message"], err


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client, vocab):
    n_prompt = len(vocab.tokenize(PROMPT, add_special=True, parse_special=True))
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                  logprobs=2)
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    # streamed: the prompt first, then the completion, the same logprobs
    streamed = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0,
                                              echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == lp.tokens
    no_logprobs = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert no_logprobs.choices[0].text == choice.text and no_logprobs.choices[0].logprobs is None


def test_token_id_prompts_are_taken_as_they_are(client, vocab):
    ids = vocab.tokenize(PROMPT, add_special=True, parse_special=True)
    by_text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    other = vocab.tokenize("Once upon a time", add_special=True, parse_special=True)
    both = client.completions.create(model="smollm2", prompt=[ids, other], max_tokens=8, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    err = _bad_request(lambda: client.completions.create(model="smollm2", prompt=[ids[0], 10 ** 9], max_tokens=2))
    assert err["param"] == "prompt"


def test_llama_server_response_formats_enforce_their_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"]}
    question = [{"role": "user", "content": "Describe Paris as JSON."}]
    for response_format in ({"type": "json_object", "schema": schema}, {"type": "json_schema", "schema": schema},
                            {"type": "json_schema", "json_schema": {"schema": schema}}):
        r = client.chat.completions.create(model="smollm2", messages=question, max_tokens=80, temperature=0,
                                           response_format=response_format)
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)


def test_llama_server_speculative_fields(client):
    base = dict(model="smollm2", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", max_tokens=40, temperature=0)
    alone = client.completions.create(**base, extra_body={"speculative": False})
    capped = client.completions.create(**base, extra_body={"speculative.n_max": 2})
    assert capped.choices[0].text == alone.choices[0].text
    assert 0 < capped.usage.drafted <= 2 * capped.usage.steps
    nested = client.completions.create(**base, extra_body={"speculative": {"n_max": 2}})
    assert nested.usage.drafted <= 2 * nested.usage.steps
    # n_min above any draft this request can make: nothing is verified
    unreachable = client.completions.create(**base, extra_body={"speculative.n_max": 2, "speculative.n_min": 3})
    assert unreachable.usage.drafted == 0 and unreachable.choices[0].text == alone.choices[0].text
    confident = client.completions.create(**base, extra_body={"speculative.p_min": 1.0})
    assert confident.choices[0].text == alone.choices[0].text
    err = _bad_request(lambda: client.completions.create(**base, extra_body={"speculative.p_min": 2}))
    assert err["param"] == "speculative.p_min"
