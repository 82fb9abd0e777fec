"""Leader election among router replicas on a coordination.k8s.io/v1 Lease.

Every replica serves picks; only the leader will write resources' status. The Lease names its holder
(`holderIdentity`) and when the holder last renewed it (`renewTime`); it is free when it has no
holder or when renewTime + leaseDurationSeconds has passed.

A candidate reads the Lease every `retry_s` and takes it when it is free (creating it when absent).
The leader renews it once it is within `renew_grace_s` of expiring. Every write is a replace carrying
the resourceVersion that was read, so of two candidates writing at once one gets 409 Conflict and
stays (or becomes) a follower.

Leadership ends at once, before anything else happens, when a renewal fails (conflict, another
holder, an API error) or when the lease would expire without a successful renewal (a watchdog on the
local monotonic clock, so that a hung API call cannot keep a stale leader). A replica whose failed
renewal left the Lease still in its name simply takes it back on its next attempt.

`stop()` releases the Lease (clears holderIdentity) so that another replica takes over without
waiting for it to expire; `stop(release=False)` just stops renewing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from lightkube import ApiError, AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from kiln.router.k8s import describe_error

log = logging.getLogger("kiln.router")


def default_identity() -> str:
    """The pod's name (POD_NAME, else the hostname) and a random suffix: a restarted pod is a new candidate."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}-{secrets.token_hex(4)}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaseLost(Exception):
    """The Lease is held by another candidate, or our write lost a race."""


class LeaderElector:
    """Campaigns for the Lease `namespace/lease_name` while started; see the module docstring.

    `is_leader` says whether this replica leads now; `leading` is an Event set while it does;
    each callback in `on_change` is called with the new value whenever it changes.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        lease_name: str,
        namespace: str,
        lease_duration_s: float,
        renew_grace_s: float,
        retry_s: float,
        identity: str | None = None,
    ) -> None:
        if not 0 < renew_grace_s < lease_duration_s:
            raise ValueError("renew_grace_s must be positive and less than lease_duration_s")
        self.client = client
        self.lease_name = lease_name
        self.namespace = namespace
        self.duration_s = float(lease_duration_s)
        self.grace_s = float(renew_grace_s)
        self.retry_s = float(retry_s)
        self.identity = identity or default_identity()
        self.leading = asyncio.Event()
        self.on_change: list[Callable[[bool], None]] = []
        self.transitions = 0  # times this replica became leader
        self._task: asyncio.Task | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._campaign(), name="leader-election")

    async def stop(self, release: bool = True) -> None:
        """Stop campaigning; with `release`, give the Lease up if this replica holds it."""
        self._set_leader(False)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if release:  # (also when not leading: a write cut short by the cancel may have landed)
            try:
                async with asyncio.timeout(min(self.grace_s, 5.0)):
                    await self._release()
            except Exception as e:  # shutting down: the lease expires by itself if the release fails
                log.warning("leader election: could not release lease %s: %s", self._where, describe_error(e))

    # ---- the loop -------------------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"{self.namespace}/{self.lease_name}"

    async def _campaign(self) -> None:
        while True:
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.grace_s):  # a renewal must land before the lease expires
                    await self._acquire_or_renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failed renewal means not leading; the loop retries
                lost = self.is_leader
                self._set_leader(False)  # first: no write may follow a failed renewal
                if lost:
                    log.warning("leader election: lost lease %s: %s", self._where, _reason(e, self))
                elif not isinstance(e, LeaseLost):
                    log.warning("leader election: lease %s: %s", self._where, _reason(e, self))
                await asyncio.sleep(self.retry_s)
                continue
            # Leading: the lease is ours until started + duration (counted from before the write was sent).
            self._arm_watchdog(started + self.duration_s)
            if not self.is_leader:
                self.transitions += 1
                log.info("leader election: %s leads (lease %s)", self.identity, self._where)
                self._set_leader(True)
            await asyncio.sleep(max(0.0, started + self.duration_s - self.grace_s - time.monotonic()))

    async def _acquire_or_renew(self) -> None:
        """One attempt; returns when this replica holds the Lease, raises otherwise."""
        now = _now()
        try:
            lease = await self.client.get(Lease, self.lease_name, namespace=self.namespace)
        except ApiError as e:
            if e.status.code != 404:
                raise
            lease = Lease(
                metadata=ObjectMeta(name=self.lease_name, namespace=self.namespace),
                spec=LeaseSpec(
                    holderIdentity=self.identity,
                    leaseDurationSeconds=_whole_seconds(self.duration_s),
                    acquireTime=now,
                    renewTime=now,
                    leaseTransitions=0,
                ),
            )
            await self._write(self.client.create(lease, namespace=self.namespace))
            return
        spec = lease.spec or LeaseSpec()
        holder = spec.holderIdentity or ""
        if holder and holder != self.identity and not _expired(spec, now):
            raise LeaseLost(f"held by {holder}")
        if holder != self.identity:
            spec.acquireTime = now
            spec.leaseTransitions = (spec.leaseTransitions or 0) + 1
        spec.holderIdentity = self.identity
        spec.leaseDurationSeconds = _whole_seconds(self.duration_s)
        spec.renewTime = now
        lease.spec = spec
        # lease.metadata.resourceVersion is the one read: a write in between makes this a 409
        await self._write(self.client.replace(lease, namespace=self.namespace))

    async def _write(self, call) -> None:
        try:
            await call
        except ApiError as e:
            if e.status.code == 409:
                raise LeaseLost("another candidate wrote the lease first") from None
            raise

    async def _release(self) -> None:
        lease = await self.client.get(Lease, self.lease_name, namespace=self.namespace)
        if lease.spec is None or lease.spec.holderIdentity != self.identity:
            return
        lease.spec.holderIdentity = None
        lease.spec.renewTime = _now()
        await self.client.replace(lease, namespace=self.namespace)
        log.info("leader election: %s released lease %s", self.identity, self._where)

    # ---- leadership -----------------------------------------------------------------------------

    def _arm_watchdog(self, deadline: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._watchdog = None
        if self.is_leader:
            self._set_leader(False)
            log.warning("leader election: lease %s expired before it could be renewed", self._where)

    def _set_leader(self, leading: bool) -> None:
        if leading == self.is_leader:
            return
        if leading:
            self.leading.set()
        else:
            self.leading.clear()
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
        for callback in list(self.on_change):
            try:
                callback(leading)
            except Exception:  # one callback's bug must not keep the others from hearing the change
                log.exception("leader election: a leadership callback failed")


def _expired(spec: LeaseSpec, now: dt.datetime) -> bool:
    if spec.renewTime is None:
        return True
    renewed = spec.renewTime if spec.renewTime.tzinfo else spec.renewTime.replace(tzinfo=dt.UTC)
    return renewed + dt.timedelta(seconds=spec.leaseDurationSeconds or 0) < now


def _whole_seconds(seconds: float) -> int:
    return max(1, round(seconds))  # leaseDurationSeconds is an integer


def _reason(error: BaseException, elector: LeaderElector) -> str:
    if isinstance(error, LeaseLost):
        return str(error)
    if isinstance(error, TimeoutError):
        return f"no answer within renew_grace_secs ({elector.grace_s:g} s)"
    return describe_error(error, elector.client)
