"""OpenAI's cursor-paged lists: the list object, and the `limit` query parameter."""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequest


def page(items: list[dict], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None}


def page_limit(limit: int | None, default: int = 20) -> int:
    """How many items a page holds: `limit`, at least 1 and with no maximum (a page holds at most
    what exists, and `has_more` says whether more does), or `default`."""
    if limit is None:
        return default
    if limit < 1:
        raise InvalidRequest("limit must be at least 1", param="limit")
    return min(limit, 2**31 - 1)  # a database limit, whatever number a client sends
