from localspec.text import TextStream

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
