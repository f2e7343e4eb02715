"""The monitor's checks of values against the wire's field types, pure: the words they say come
from ``marduk.wire.fields`` (its patterns' meanings), not the regexes."""

from __future__ import annotations

import pytest
import typer

from marduk.wire.protocol import DeviceId, ShortText, Token
from monitor_cli.console import expected, wire_check


def test_expected_says_the_pattern_and_the_length_in_words() -> None:
    assert expected(DeviceId) == "printable ASCII without spaces, at most 256 characters"
    assert expected(ShortText) == "at most 256 characters"
    assert "starting with a letter or digit" in expected(Token)


def test_wire_check_passes_good_values_and_lists_and_names_the_bad_one() -> None:
    check = wire_check(DeviceId)
    assert check("GPU-1") == "GPU-1" and check(["a", "b"]) == ["a", "b"] and check(None) is None
    with pytest.raises(typer.BadParameter, match="'bad device': expected printable ASCII"):
        check(["ok", "bad device"])
    with pytest.raises(typer.BadParameter):
        check("")


def test_usage_messages_lose_typers_pydantic_prefix() -> None:
    from marduk.cli import usage_message

    said = "Invalid value for '--state': Value error, 'bogus' is not one of 'live', 'stale'."
    assert (
        usage_message(said) == "Invalid value for '--state': 'bogus' is not one of 'live', 'stale'"
    )
    plain = "No such option: --bogus"
    assert usage_message(plain) == plain
