"""Checking bearer tokens with the API server's TokenReview (authentication.k8s.io/v1), with a cache.

Answers are cached by (sha256 of the token, audiences): an authenticated token for
`positive_ttl_secs`, a rejected one for `negative_ttl_secs`, at most `max_cache_entries` entries
(the least recently used go first). An API server that fails or does not answer within the deadline
is an error (ReviewUnavailable), never cached: the next call asks again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightkube import AsyncClient
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview

from kiln.router.config import TokenReview as TokenReviewConfig
from kiln.router.k8s import describe_error


@dataclass(frozen=True)
class Review:
    authenticated: bool
    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    error: str = ""  # why a token was not authenticated


class ReviewUnavailable(Exception):
    """The API server could not review the token (unreachable, an error, or past the deadline)."""


class TokenReviewer:
    def __init__(
        self,
        client: AsyncClient,
        *,
        deadline_s: float,
        positive_ttl_s: float,
        negative_ttl_s: float,
        max_entries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.positive_ttl_s = positive_ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.cache: OrderedDict[tuple[str, tuple[str, ...]], tuple[float, Review]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_config(cls, client: AsyncClient, config: TokenReviewConfig) -> TokenReviewer:
        return cls(
            client,
            deadline_s=config.default_deadline_ms / 1000,
            positive_ttl_s=config.positive_ttl_secs,
            negative_ttl_s=config.negative_ttl_secs,
            max_entries=config.max_cache_entries,
        )

    async def review(self, token: str, audiences: Sequence[str] = (), deadline_s: float | None = None) -> Review:
        """The cached or fresh answer; `deadline_s` (e.g. the caller's own) shortens the configured one.

        Raises ReviewUnavailable when the API server cannot answer in time.
        """
        key = (hashlib.sha256(token.encode()).hexdigest(), tuple(audiences))
        now = self.clock()
        cached = self.cache.get(key)
        if cached is not None:
            expires, review = cached
            if now < expires:
                self.cache.move_to_end(key)
                self.hits += 1
                return review
            del self.cache[key]
        self.misses += 1
        deadline = self.deadline_s if deadline_s is None else max(0.0, min(self.deadline_s, deadline_s))
        review = await self._ask(token, list(audiences), deadline)
        ttl = self.positive_ttl_s if review.authenticated else self.negative_ttl_s
        if ttl > 0 and self.max_entries > 0:
            self.cache[key] = (self.clock() + ttl, review)
            self.cache.move_to_end(key)
            while len(self.cache) > self.max_entries:
                self.cache.popitem(last=False)
        return review

    async def _ask(self, token: str, audiences: list[str], deadline_s: float) -> Review:
        request = TokenReview(spec=TokenReviewSpec(token=token, audiences=audiences or None))
        try:
            async with asyncio.timeout(deadline_s):
                answer = await self.client.create(request)
        except TimeoutError:
            raise ReviewUnavailable(
                f"the Kubernetes API server did not review the token within {deadline_s * 1000:g} ms"
            ) from None
        except Exception as e:  # lightkube and httpx raise many types: all mean the review is unavailable
            raise ReviewUnavailable(f"cannot review the token: {describe_error(e, self.client)}") from None
        status = answer.status
        if status is None or not status.authenticated:
            error = (status.error if status is not None else None) or "the token is not authenticated"
            return Review(authenticated=False, error=error)
        user = status.user
        if user is None:
            return Review(authenticated=True)
        return Review(
            authenticated=True, username=user.username or "", uid=user.uid or "", groups=tuple(user.groups or ())
        )
