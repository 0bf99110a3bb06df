"""A token read from a file or the environment, and token-shaped text in what is shown."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.client.session import Session
from gpufleet.errors import ConfigError
from gpufleet.tokens import clean, redact, redact_data

TOKEN = "gf_" + "Ab3_-" * 8 + "xyz"


@pytest.mark.parametrize("padded", [TOKEN + "\n", f"  {TOKEN}\r\n", f"\t{TOKEN} "])
def test_surrounding_whitespace_is_dropped(padded: str) -> None:
    assert clean(padded) == TOKEN


@pytest.mark.parametrize(
    ("inside", "said"),
    [
        ("\n", "a newline"),
        (" ", "a space"),
        ("\t", "a tab"),
        ("\r", "a carriage return"),
        ("\x00", "a control character (U+0000)"),
        ("é", "a non-ASCII character (U+00E9)"),
    ],
)
def test_whitespace_inside_is_named_with_its_position_and_the_token_is_not_shown(
    inside: str, said: str
) -> None:
    broken = TOKEN[:10] + inside + TOKEN[10:]
    with pytest.raises(ConfigError) as caught:
        clean(broken, "GPUFLEET_TOKEN")
    message = caught.value.message
    assert message.startswith(f"GPUFLEET_TOKEN: the token contains {said} at position 11")
    assert TOKEN[3:10] not in message and TOKEN[10:] not in message


def test_token_shaped_text_is_cut_to_its_hint() -> None:
    text = f"no job '{TOKEN}' (http://{TOKEN}.example:9, Bearer {TOKEN}x)"
    shown = redact(text)
    assert TOKEN[7:] not in shown and shown.count(TOKEN[:7] + "…") == 3
    assert redact("gf_short and gfx_abcdefghijkl stay") == "gf_short and gfx_abcdefghijkl stay"
    assert redact_data({"job": TOKEN, "list": [TOKEN], "n": 3}) == {
        "job": TOKEN[:7] + "…",
        "list": [TOKEN[:7] + "…"],
        "n": 3,
    }


def test_a_session_string_is_hidden_only_when_it_holds_a_token() -> None:
    plain = Session("http://h:8000", "default", "w-1").encode()
    secret = Session("http://h:8000", "default", "w-1", TOKEN).encode()
    assert redact(f"session: {plain}") == f"session: {plain}"
    shown = redact(f"session: {secret}")
    assert secret not in shown and "holds a token" in shown


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=60))
def test_redacting_twice_changes_nothing_more_and_leaves_no_long_token(text: str) -> None:
    once = redact(text + TOKEN)
    assert redact(once) == once
    assert TOKEN[7:] not in once
