"""Live parameters in the trainer (decisions.md #20): ``client.params``, ``on_params``,
``client.params_applied``.

The controller publishes a job's whole document (``marduk.wire.params.JobParams``) when an
operator sets it, again while a worker is behind, and in every registration's reply. Versions
fence it: a document not above the version held is not news. What this replica runs is the
job's values updated with its own (``--replica``); a new version that changes nothing here is
acknowledged at once, without a callback.

The trainer reads ``client.params`` (a read-only mapping with ``version``) at a step boundary,
or is told by ``on_params`` (on the client's thread: keep it short, e.g. set a flag), applies
the values at its next step boundary and calls ``client.params_applied(version)``, with
``rejected={"lr": "above 1.0"}`` for keys it refused. Without an ``on_params`` callback the
library acknowledges on receipt: reading ``client.params`` each step is applying them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from marduk.wire.params import JobParams, ParamValue, RankApplied


class ParamsView(Mapping[str, ParamValue]):
    """The parameters this replica runs, read-only, at ``version`` (0: none set)."""

    __slots__ = ("_values", "version")

    def __init__(self, version: int = 0, values: Mapping[str, ParamValue] | None = None) -> None:
        self.version = version
        self._values: Mapping[str, ParamValue] = MappingProxyType(dict(values or {}))

    def __getitem__(self, key: str) -> ParamValue:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ParamsView(version={self.version}, {dict(self._values)!r})"


OnParams = Callable[[ParamsView], Any]


class Offer(enum.Enum):
    STALE = "stale"  # not above the version held: acknowledge again what we run
    SAME = "same"  # a new version that changes nothing for this replica: acknowledged at once
    NEWS = "news"  # new values: the trainer applies them (or the library, without a callback)


class LiveParams:
    """The fence and the current view; no I/O (the client sends the acknowledgements)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.view = ParamsView()
        self.on_params: OnParams | None = None
        # The last acknowledgement: (version, rejected), said again when the controller asks.
        self.acked: tuple[int, dict[str, str]] | None = None
        self.doc: JobParams | None = None  # the job's latest document (a supervisor forwards it)

    def offer(self, doc: JobParams) -> Offer:
        if doc.version <= self.view.version:
            return Offer.STALE
        values = doc.effective(self.replica)
        same = values == dict(self.view)
        self.view = ParamsView(doc.version, values)
        self.doc = doc
        return Offer.SAME if same else Offer.NEWS

    def take(
        self, doc: JobParams, *, said_again: bool, on_error: Callable[[Exception], None]
    ) -> tuple[int, dict[str, str]] | None:
        """A document from the controller (or the supervisor): what to acknowledge now, if
        anything. News goes to ``on_params`` (the trainer acknowledges it); without one, or
        when nothing changes here, it is acknowledged at once. One at the version we run,
        ``said_again`` (the controller asking who runs what): the last acknowledgement again."""
        offer = self.offer(doc)
        if offer is Offer.STALE:
            if said_again and self.acked is not None and self.acked[0] == doc.version:
                return self.acked
            return None
        if offer is Offer.SAME or self.on_params is None:
            return doc.version, {}
        try:
            self.on_params(self.view)
        except Exception as e:  # the trainer's bug, never the library's loop's
            on_error(e)
        return None


def merge_rank_acks(
    acks: Mapping[int, tuple[int, Mapping[str, str]]], ranks: int
) -> tuple[int, dict[str, str], list[RankApplied]]:
    """A supervisor's word for its worker from its local ranks' (rank -> (version, rejected)):
    the lowest version of the ``ranks`` (one that has not acknowledged counts as 0), every
    refusal, and each rank's acknowledgement."""
    version = min((acks.get(i, (0, {}))[0] for i in range(ranks)), default=0)
    rejected: dict[str, str] = {}
    for _, (_, refused) in sorted(acks.items()):
        rejected.update(refused)
    detail = [
        RankApplied(rank=i, version=v, rejected=dict(r))
        for i, (v, r) in sorted(acks.items())
        if i < ranks
    ]
    return version, rejected, detail
