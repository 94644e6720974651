from localspec.runtime.text import TextStream

PIECES = {1: "Hello", 2: ",", 3: " wor", 4: "ld", 5: "!", 6: " EN", 7: "D", 8: " more"}


def stream(stops=()):
    return TextStream(lambda t: PIECES[t], lambda: "", stops)


def run(tokens, stops=()):
    s = stream(stops)
    released = []
    for t in tokens:
        stopped = s.add(t)
        released.append(s.release())
        if stopped:
            break
    released.append(s.finish())
    return s, released


def test_no_stops_releases_everything_as_it_comes():
    s, released = run([1, 2, 3, 4])
    assert released == ["Hello", ",", " wor", "ld", ""]
    assert s.text == "Hello, world"


def test_stop_string_spanning_tokens_is_cut_and_never_released():
    s, released = run([1, 2, 3, 4, 5, 6, 7, 8], stops=[" END"])
    assert s.stopped
    assert "".join(released) == "Hello, world!"
    assert all("END" not in r and " EN" not in r for r in released)


def test_possible_stop_prefix_is_held_back_then_released():
    s = stream([" world peace"])
    s.add(1)
    s.add(2)
    s.add(3)  # " wor" could start the stop string
    assert s.release() == "Hello,"
    s.add(4)  # " world" still could
    assert s.release() == ""
    s.add(5)  # "!" breaks it
    assert s.release() == " world!"
    assert not s.stopped


def test_earliest_stop_wins_and_finish_flushes():
    s, released = run([1, 2, 3, 4], stops=["ld", ","])
    assert "".join(released) == "Hello"


def test_held_back_tail_is_released_at_finish():
    s = stream(["world!"])
    s.add(3)
    s.add(4)
    assert s.release() == " "  # "world" may still become "world!"
    assert s.finish() == "world"


def test_utf8_split_across_tokens_via_detokenizer_flush():
    import codecs

    data = {1: "é".encode()[:1], 2: "é".encode()[1:]}
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    s = TextStream(lambda t: dec.decode(data[t]), lambda: dec.decode(b"", final=True))
    s.add(1)
    assert s.release() == ""
    s.add(2)
    assert s.release() == "é"


# ---------------------------------------------------------------- labelled streams (spans)


def run_labelled(tokens, labels, stops=(), feed=None, flush=None):
    """Each release (and the finish) with the spans handed out after it: [(text, spans)]."""
    s = TextStream(feed or (lambda t: PIECES[t]), flush or (lambda: ""), stops, labelled=True)
    out = []
    for t, label in zip(tokens, labels):
        stopped = s.add(t, label)
        out.append((s.release(), s.spans()))
        if stopped:
            break
    out.append((s.finish(), s.spans()))
    return s, out


def test_spans_add_up_to_each_release_and_carry_each_tokens_label():
    s, out = run_labelled([1, 2, 3, 4], ["oracle", "draft", "draft", "lookup"])
    for text, spans in out:
        assert "".join(piece for piece, _ in spans) == text
    assert [spans for _, spans in out] == [[("Hello", "oracle")], [(",", "draft")], [(" wor", "draft")],
                                           [("ld", "lookup")], []]


def test_held_back_text_keeps_its_tokens_labels_when_released_later():
    s, out = run_labelled([1, 2, 3, 4, 5], ["a", "b", "c", "d", "e"], stops=[" world peace"])
    assert out[:2] == [("Hello", [("Hello", "a")]), (",", [(",", "b")])]
    assert out[2] == out[3] == ("", [])  # " wor", then " world", could still start the stop string
    assert out[4] == (" world!", [(" wor", "c"), ("ld", "d"), ("!", "e")])


def test_a_stop_string_spanning_tokens_cuts_their_spans_too():
    s, out = run_labelled([1, 2, 3, 4, 5, 6, 7, 8], list("abcdefgh"), stops=["d! E"])
    released = [(piece, label) for _, spans in out for piece, label in spans]
    assert "".join(text for text, _ in out) == "Hello, worl" == "".join(p for p, _ in released)
    assert released == [("Hello", "a"), (",", "b"), (" wor", "c"), ("l", "d")]  # "d" of "ld" was the stop's


def test_a_character_split_across_tokens_belongs_to_the_token_that_completed_it():
    import codecs

    data = {1: b"caf", 2: "é".encode()[:1], 3: "é".encode()[1:] + b"!", 4: "è".encode()[:1]}
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    s, out = run_labelled([1, 2, 3, 4], ["a", "b", "c", "d"], feed=lambda t: dec.decode(data[t]),
                          flush=lambda: dec.decode(b"", final=True))
    released = [(piece, label) for _, spans in out for piece, label in spans]
    # token 2 held half of "é": no text of its own; the flushed half of "è" is the last token's
    assert released == [("caf", "a"), ("é!", "c"), ("\ufffd", "d")]
    assert "".join(p for p, _ in released) == s.text
