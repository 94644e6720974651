from dataclasses import dataclass, field

import pytest

from localspec.speculative.compat import IncompatibleModels, check_compatible, first_difference


@dataclass
class FakeVocab:
    name: str = "m"
    n_vocab: int = 300
    vocab_type: int = 2
    bos: int = 1
    eos: int = 2
    add_bos: bool = False
    add_eos: bool = False
    overrides: dict = field(default_factory=dict)
    vocab_digest: bytes | None = None
    asked: int = 0

    def token_text(self, token: int) -> bytes:
        self.asked += 1
        return self.overrides.get(token, f"t{token}".encode())


def test_identical_vocabularies_are_compatible():
    assert first_difference(FakeVocab(), FakeVocab(n_vocab=320)) is None
    check_compatible(FakeVocab(), FakeVocab())


@pytest.mark.parametrize("change, words", [
    ({"vocab_type": 1}, "vocabulary types differ: oracle BPE, draft SPM"),
    ({"add_bos": True}, "add_bos differs: oracle False, draft True"),
    ({"eos": 7}, "eos differs: oracle 2, draft 7"),
    ({"n_vocab": 500}, "vocabulary sizes differ by more than 128: oracle 300, draft 500"),
    ({"overrides": {42: b"x"}}, "token 42 differs: oracle b't42', draft b'x'"),
])
def test_first_difference_is_named(change, words):
    assert first_difference(FakeVocab(), FakeVocab(**change)) == words


def test_tokens_below_5_are_not_compared():
    assert first_difference(FakeVocab(), FakeVocab(overrides={3: b"<pad>"})) is None


def test_error_points_to_cross_tokenizer():
    with pytest.raises(IncompatibleModels, match=r"vocabulary types differ.*Pick a draft from the oracle's model "
                                                 r"family.*--cross-tokenizer \(cross_tokenizer=True"):
        check_compatible(FakeVocab(name="gemma"), FakeVocab(name="smol", vocab_type=1))


def test_error_names_both_models():
    with pytest.raises(IncompatibleModels, match=r"draft 'small' cannot draft for oracle 'big': token 9"):
        check_compatible(FakeVocab(name="big"), FakeVocab(name="small", overrides={9: b"?"}))


@pytest.mark.model
def test_smollm2_and_gemma_are_incompatible(registry, pair_paths):
    from localspec.llama.context import LlamaModel

    with LlamaModel(pair_paths[1]) as smol, LlamaModel(registry.resolve("gemma-3-270m-q4_k_m")) as gemma:
        diff = first_difference(gemma, smol)
        assert diff is not None and "differ" in diff
        with pytest.raises(IncompatibleModels, match="cannot draft for oracle"):
            check_compatible(gemma, smol)
        # and the pair that should work does
        with LlamaModel(pair_paths[0]) as oracle:
            check_compatible(oracle, smol)


def test_equal_vocabulary_digests_skip_the_token_by_token_comparison():
    oracle, draft = FakeVocab(vocab_digest=b"same"), FakeVocab(vocab_digest=b"same")
    assert first_difference(oracle, draft) is None
    assert oracle.asked == draft.asked == 0


def test_different_or_unknown_digests_compare_token_by_token():
    assert first_difference(FakeVocab(vocab_digest=b"a"), FakeVocab(vocab_digest=b"b", overrides={42: b"x"})) \
        == "token 42 differs: oracle b't42', draft b'x'"
    assert first_difference(FakeVocab(vocab_digest=b"a"), FakeVocab(vocab_digest=b"b")) is None  # e.g. ids < 5
    oracle, draft = FakeVocab(), FakeVocab()  # digests unknown
    assert first_difference(oracle, draft) is None and oracle.asked == 295
    # the scalar rules come first, whatever the digests say
    assert first_difference(FakeVocab(vocab_digest=b"s"), FakeVocab(vocab_digest=b"s", eos=7)) \
        == "eos differs: oracle 2, draft 7"
