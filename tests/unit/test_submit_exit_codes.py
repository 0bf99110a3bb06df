"""submit's --retry-on / --no-retry-on words as exit codes."""

from __future__ import annotations

import pytest

from gpufleet.cli.submit import exit_codes
from gpufleet.errors import ConfigError


def test_exit_codes_are_read_from_commas_and_repeated_flags() -> None:
    assert exit_codes(["4,5", " 7 ", "-1"], "--no-retry-on") == [4, 5, 7, -1]
    assert exit_codes(None, "--retry-on") == []


@pytest.mark.parametrize("word", ["--4", "²", "\uff11", "1_0", "+4", "x", "4.0", "-"])
def test_a_word_that_is_not_an_exit_code_is_named_with_the_flag(word: str) -> None:
    with pytest.raises(ConfigError) as info:
        exit_codes([f"3,{word}"], "--no-retry-on")
    assert str(info.value).startswith(f"--no-retry-on: {word!r} is not an exit code")
