from server.detokenizer import IncrementalDetokenizer

VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\n"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def feed(detok, ids):
    return [detok.add(i) for i in ids]


def test_plain_text_streams_token_by_token():
    d = IncrementalDetokenizer(decode)
    assert feed(d, [1, 2, 3, 4]) == ["Hel", "lo", " wor", "ld"]
    assert d.flush() == ""


def test_stop_string_cuts_text_and_holds_back_partial_matches():
    d = IncrementalDetokenizer(decode, stop=["world"])
    out = feed(d, [1, 2, 3])
    assert "".join(out) == "Hello"[: len("".join(out))]
    assert not d.is_stopped
    out += feed(d, [4])
    assert d.is_stopped and "".join(out) + d.flush() == "Hello "


def test_held_text_is_flushed_at_the_end():
    d = IncrementalDetokenizer(decode, stop=["xyz!"])
    text = "".join(feed(d, [1, 2, 5]))
    assert text + d.flush() == "Hello!"


def test_incomplete_utf8_waits_for_the_next_token():
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9!"}

    def dec(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    d = IncrementalDetokenizer(dec)
    assert [d.add(i) for i in [1, 2, 3]] == ["caf", "", "é!"]
