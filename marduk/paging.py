"""Pages that fit: split an answer of many items into replies under a byte budget (pure).

DESIGN.md decision 12: no message exceeds the server's max payload. The controller measures
each item's encoded size once, then cuts pages greedily; a page always holds at least one item
(an item larger than the budget is the caller's error to report).
"""

from __future__ import annotations

from collections.abc import Sequence

# Room for the envelope of a page (controller info, counters, paging fields).
ENVELOPE_BYTES = 16 * 1024


def page_end(sizes: Sequence[int], start: int, budget: int) -> int:
    """The end (exclusive) of the page starting at ``start`` whose items fit in ``budget``.

    Each item costs its size plus one byte (the comma between list items).
    """
    end, used = start, 0
    while end < len(sizes):
        cost = sizes[end] + 1
        if end > start and used + cost > budget:
            break
        used += cost
        end += 1
    return end
