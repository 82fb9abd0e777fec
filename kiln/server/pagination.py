"""OpenAI's cursor-paged lists: the list object, and the `limit` query parameter."""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequest


def page(items: list[dict], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None}


def page_limit(limit: int | None, default: int = 20) -> int:
    if limit is None:
        return default
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be from 1 to 100", param="limit")
    return limit
