"""Stop strings across arbitrary delta boundaries (blink.dpu.stop_strings)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink.dpu.stop_strings import StopStringMatcher

# A small alphabet (with multi-byte characters) so that stop strings and their prefixes occur
# often in random text.
_ALPHABET = st.sampled_from(list("ab c\n日😀"))
_TEXT = st.text(alphabet=_ALPHABET, max_size=40)
_STOP = st.text(alphabet=_ALPHABET, min_size=1, max_size=5)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    """Feed deltas like the server does; flush only if the stream ends without a match."""
    out: list[str] = []
    for d in deltas:
        out.append(matcher.feed(d))
        if matcher.matched is not None:
            return out, True
    out.append(matcher.flush())
    return out, False


def _reference(text: str, stops: list[str], include: bool) -> str:
    """Character-at-a-time semantics: cut at the first stop string to complete."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)  # two complete at once: the longer starts earlier
            return text[:end] if include else text[: end - len(stop)]
    return text


@settings(max_examples=300, deadline=None)
@given(prefix=_TEXT, stop=_STOP, suffix=_TEXT, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_single_stop_string_never_leaks(prefix: str, stop: str, suffix: str,
                                        cuts: list[int]) -> None:
    text = prefix + stop + suffix
    expected = text[: text.find(stop)]
    out, matched = _run(StopStringMatcher([stop]), _split(text, cuts))
    assert matched
    assert "".join(out) == expected
    sent = ""
    for piece in out:  # at no moment has the client seen the stop string, or wrong text
        sent += piece
        assert stop not in sent
        assert expected.startswith(sent)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, stops=st.lists(_STOP, min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 200), max_size=12), include=st.booleans())
def test_matches_character_at_a_time_reference(text: str, stops: list[str], cuts: list[int],
                                               include: bool) -> None:
    """However the text is split, the output is that of a one-character-at-a-time stream."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out, matched = _run(matcher, _split(text, cuts))
    expected = _reference(text, stops, include)
    assert "".join(out) == expected
    assert matched == any(s in text for s in stops)
    if not include:
        assert not any(s in "".join(out) for s in stops)


def test_include_stop_str_in_output_truncates_after_the_stop() -> None:
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert m.feed("abc E") == "abc E"  # nothing is held back in this mode
    assert m.feed("NDxyz") == "ND"
    assert m.matched == "END"


def test_partial_match_is_held_then_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == "hello "
    assert m.feed("O") == ""
    assert m.feed("P!") == ""
    assert m.matched == "STOP"
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == "hello "
    assert m.feed("ART") == "START"  # no longer a possible stop string
    assert m.feed("STO") == ""
    assert m.flush() == "STO"  # the stream ended: held text is released


def test_inactive_feed_sends_everything_and_matches_nothing() -> None:
    m = StopStringMatcher(["ab"])
    assert m.feed("xa", active=False) == "xa"
    # the held-back-free "a" cannot combine with a later "b": min_tokens had not been reached
    assert m.feed("b c", active=True) == "b c"
    assert m.matched is None
    assert m.feed("ab") == ""
    assert m.matched == "ab"


def test_no_stop_strings_is_a_pass_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == "anything"
    assert m.flush() == ""


def test_feed_after_match_and_empty_stop_are_errors() -> None:
    m = StopStringMatcher(["x"])
    m.feed("x")
    with pytest.raises(RuntimeError):
        m.feed("more")
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_stop_token_is_hidden_when_the_finish_comes_in_the_next_delta() -> None:
    # The ring's poller may read the stop token before the slot's FINISHED state: the token
    # arrives with finished=False and the finish in an empty delta after it.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dpu_helpers import tiny_tokenizer

    from blink.dpu.output_processor import ChoiceText
    from blink.shared.sampling_params import SamplingParams

    tok = tiny_tokenizer()
    answer = tok.encode("Hello world", add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    for include in (False, True):
        params = SamplingParams(stop_token_ids=[eos], skip_special_tokens=False)
        text = ChoiceText(tok, [1], params, include_stop_str_in_output=include)
        parts = [text.feed(answer + [eos], False, None).text, text.feed([], True, "stop").text]
        assert "".join(parts) == "Hello world" + ("<|im_end|>" if include else "")
        assert text.completion_tokens == len(answer) + 1 and text.finish_reason == "stop"
