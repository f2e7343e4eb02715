"""``marduk torchft-lighthouse``'s mistakes are one line and exit 2, before anything starts."""

from __future__ import annotations

import pytest

from tests.conftest import marduk_cli
from tests.integration.test_cli_errors import one_error_line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--min-replicas", "2"], "Missing option '--job'"),
        (["--job", "ft"], "Missing option '--min-replicas'"),
        (["--job", "ft", "--min-replicas", "0"], "0 is not in the range x>=1"),
        (
            ["--job", "ft", "--min-replicas", "2", "--inner-timeout-ms", "20"],
            "--inner-timeout-ms must be above --beat-every-ms",
        ),
        (
            ["--job", "ft", "--min-replicas", "2", "--inner-timeout-ms", "1000"],
            "and below --heartbeat-timeout-ms",
        ),
        (
            [
                "--job",
                "ft",
                "--min-replicas",
                "2",
                "--heartbeat-timeout-ms",
                "100",
                "--inner-timeout-ms",
                "50",
            ],
            "--heartbeat-timeout-ms must be above the Managers' 100 ms beats",
        ),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    r = marduk_cli("torchft-lighthouse", *args, env={"COLUMNS": "200"})
    assert r.returncode == 2, r.stderr
    assert said in one_error_line(r)


def test_help_says_what_it_is_for() -> None:
    r = marduk_cli("torchft-lighthouse", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for text in ("--inner-timeout-ms", "--rebuild-ms", "TORCHFT_QUORUM_RETRIES", "--job"):
        assert text in r.stdout, r.stdout
