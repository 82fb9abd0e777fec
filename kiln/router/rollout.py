"""Fleet-wide adapter promotion: `POST /admin/adapters/rollout` brings one version of an adapter from a
store the workers share onto a growing fraction of the fleet, stage by stage, through each worker's
adapter API (`POST /v1/adapters` with the version's path), and checks it between stages.

- The fleet: every alive, non-evicted worker with an HTTP address whose base model is the adapter's
  or that lists the adapter in /v1/models. Workers go in stages in worker-set, then worker-id order;
  stage k holds the first ceil(stages[k] x fleet) of them.
- Checks after each stage's loads and a bake time: the workers' error rates (Feedback the router got
  for requests for the adapter, per worker it touched, and none of them dead or evicted) and, with an
  `eval_id`, the eval gate's rules on the stage's first new worker (its `eval host`): a baseline run
  of what it served before the load (its previous version, else its base model), a run of the new
  version after, compared there; each criterion's candidate pass rate at least `min_pass_rate` and
  paired difference at least `min_delta`. An eval lives in one worker's database; a host without it
  gets a copy (same criteria, the items inline) made for the rollout.
- A failing check, or a load that fails, rolls back every worker the rollout touched: the previous
  version loaded again, or the adapter unloaded where it had none (after `drain_secs`, during which
  the worker is no longer picked for it).
- While a rollout runs, requests for the adapter go only to workers known to serve a version of it
  now (the previous or the new one): a worker that would load it on demand, or is about to unload it,
  is not picked. Only when no worker qualifies does picking fall back to the usual rules.
- State: the rollouts are kept in memory and, with `[rollout] state_file`, written to that file at
  every change; a restarted router resumes a running rollout at its current stage (loads it finds done
  are not redone). With leader election only the leader runs rollouts and accepts new ones.
- Idempotent: posting a rollout equal to one that runs or completed returns it; another rollout of
  the same adapter while one runs is refused with 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx

from kiln.router.config import RolloutSettings, Worker

log = logging.getLogger("kiln.router")

# what makes two rollouts the same one (a second post of it is answered with the first)
SAME = ("name", "version", "store", "stages", "eval_id", "criteria", "min_delta", "min_pass_rate")
KEYS = (*SAME, "data_source", "bake_secs", "max_error_rate")  # what a request may name
RUNNING = ("running", "rolling_back")
KEEP = 50  # finished rollouts kept in the state
EVAL_POLL_S = 0.5
EVAL_TIMEOUT_S = 3600.0
LOAD_TIMEOUT_S = 600.0
SETTLE_S = 5.0  # after a rollout ends, its view still steers picks while the workers' /v1/models catch up


class Fleet(Protocol):
    """What rollouts read of the router (core.RouterCore, which holds them)."""

    leader_election: Any  # a leader.LeaderElector, or None
    scraper: Any  # a scrape.Scraper, or None (mock mode)

    def is_leader(self) -> bool | None: ...

    def fleet(self) -> list[Worker]:
        """Every worker that may be picked now (alive, not evicted), by worker set, then worker id."""
        ...

    def why_ineligible(self, worker_id_num: int) -> str | None:
        """Why the worker may not be picked now (dead, evicted, gone), or None."""
        ...

    def base_model_of(self, worker: Worker) -> str: ...

    def lists(self, worker: Worker, model: str) -> bool:
        """Whether the worker serves `model` by its configuration or its /v1/models."""
        ...


class RolloutRefused(Exception):
    """A rollout request that cannot start: `status` 400 (naming `param`), 409 or 503."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status == 400 else "conflict" if self.status == 409 else "unavailable"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class CheckFailed(Exception):
    """A stage's check, or a worker's load, failed: the rollout rolls back."""


@dataclasses.dataclass
class Target:
    """One worker of a rollout. `state`: waiting, loading, serving (the new version), restoring,
    restored, draining (being taken off the adapter before an unload)."""

    worker: str
    worker_id_num: int
    url: str
    base_model: str
    stage: int
    previous: str | None  # the version it served before the rollout touched it; None: none
    state: str = "waiting"

    def serves(self) -> bool:
        """Whether requests for the adapter may go to it now."""
        return self.state == "serving" or (self.previous is not None and self.state != "draining")


@dataclasses.dataclass
class Rollout:
    id: str
    name: str
    version: str
    store: str
    stages: list[float]
    eval_id: str | None
    criteria: list[str]
    min_delta: float
    min_pass_rate: float
    data_source: dict[str, Any] | None
    bake_secs: float
    max_error_rate: float
    targets: list[Target]
    eval_source: str | None = None  # the worker the eval was found on
    eval_copies: dict[str, str] = dataclasses.field(default_factory=dict)  # worker -> its copy's id
    status: str = "running"  # running, rolling_back, completed, rolled_back, failed
    stage: int = 0  # the stage under way (1-based); 0 before the first
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reason: str | None = None
    created_at: float = dataclasses.field(default_factory=time.time)
    updated_at: float = dataclasses.field(default_factory=time.time)

    @property
    def path(self) -> str:
        return str(Path(self.store) / self.name / self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "object": "adapter.rollout",
            **dataclasses.asdict(self),
            "stage_workers": [sum(1 for t in self.targets if t.stage <= k) for k in range(1, len(self.stages) + 1)],
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Rollout:
        fields = {f.name for f in dataclasses.fields(Rollout)}
        rollout = Rollout(**{k: v for k, v in doc.items() if k in fields})
        rollout.targets = [Target(**t) for t in doc["targets"]]
        return rollout

    def same_as(self, spec: dict[str, Any]) -> bool:
        return all(getattr(self, k) == spec[k] for k in SAME)


class Rollouts:
    """The router's rollouts (see the module docstring); every method runs on the router's loop."""

    def __init__(self, core: Fleet, settings: RolloutSettings) -> None:
        self.core = core
        self.settings = settings
        self.items: dict[str, Rollout] = {}  # by id, oldest first
        self.tasks: dict[str, asyncio.Task] = {}
        self.picks: dict[str, tuple[str, int]] = {}  # request id -> (rollout id, worker) for the error rates
        self.window: dict[str, dict[int, list[int]]] = {}  # rollout id -> worker -> [answered, failed]
        self.client: httpx.AsyncClient | None = None
        self.ended: dict[str, tuple[Rollout, float]] = {}  # name -> the rollout that just ended, when (monotonic)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
        self._read_state()
        elector = self.core.leader_election
        if elector is not None:
            elector.on_change.append(self._leadership)
        self._resume()

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.client is not None:
            await self.client.aclose()

    def _leads(self) -> bool:
        return self.core.is_leader() is not False

    def _leadership(self, leading: bool) -> None:
        if leading:
            self._read_state()  # another leader may have moved the rollouts on
            self._resume()
        else:
            for task in self.tasks.values():
                task.cancel()

    def _resume(self) -> None:
        if not self._leads():
            return
        for rollout in self.items.values():
            if rollout.status in RUNNING and rollout.id not in self.tasks:
                log.info(
                    "rollout %s of %s version %s: resuming at stage %d",
                    rollout.id,
                    rollout.name,
                    rollout.version,
                    max(rollout.stage, 1),
                )
                self._run(rollout)

    def _read_state(self) -> None:
        path = self.settings.state_file
        if path is None or not path.exists():
            return
        try:
            docs = json.loads(path.read_text())["rollouts"]
            self.items = {d["id"]: Rollout.from_json(d) for d in docs}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("rollout state %s cannot be read (%s); starting without it", path, e)

    def _save(self, rollout: Rollout | None = None) -> None:
        if rollout is not None:
            rollout.updated_at = time.time()
        finished = [r.id for r in self.items.values() if r.status not in RUNNING]
        for rid in finished[: max(0, len(finished) - KEEP)]:
            del self.items[rid]
        path = self.settings.state_file
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(json.dumps({"rollouts": [r.to_json() for r in self.items.values()]}, indent=1))
        staging.replace(path)

    # ---- reading --------------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in reversed(self.items.values())]

    def running(self, name: str) -> Rollout | None:
        return next((r for r in self.items.values() if r.name == name and r.status in RUNNING), None)

    def steering(self, name: str) -> Rollout | None:
        """The rollout whose view of the workers decides where requests for `name` go: one that runs,
        or one that ended moments ago (until the workers' /v1/models have been read since)."""
        rollout = self.running(name)
        if rollout is None and name in self.ended:
            ended, at = self.ended[name]
            rollout = ended if time.monotonic() - at < SETTLE_S else None
        return rollout

    def serves(self, model: str, worker_id_num: int) -> bool:
        """Whether the rollout steering `model` knows the worker to serve a version of it."""
        rollout = self.steering(model)
        return rollout is not None and any(t.worker_id_num == worker_id_num and t.serves() for t in rollout.targets)

    def eligible(self, model: str, workers: list) -> list:
        """`workers` less those the rollout steering `model` does not know to serve it (all of them
        when none would be left)."""
        rollout = self.steering(model)
        if rollout is None:
            return workers
        serving = {t.worker_id_num for t in rollout.targets if t.serves()}
        kept = [w for w in workers if w.worker_id_num in serving]
        return kept or workers

    # ---- error rates ----------------------------------------------------------------------------

    def picked(self, request_id: str, model: str, worker_id_num: int) -> None:
        rollout = self.running(model)
        if rollout is not None:
            self.picks[request_id] = (rollout.id, worker_id_num)

    def feedback(self, request_id: str, failed: bool) -> None:
        rollout_id, worker = self.picks.pop(request_id, (None, 0))
        window = self.window.get(rollout_id) if rollout_id else None
        if window is not None:
            counts = window.setdefault(worker, [0, 0])
            counts[0] += 1
            counts[1] += int(failed)

    # ---- a new rollout --------------------------------------------------------------------------

    async def create(self, body: Any) -> tuple[int, dict[str, Any]]:
        """(status, rollout) for a request; raises RolloutRefused."""
        if not self._leads():
            raise RolloutRefused(
                503, "this router replica is not the leader; post the rollout to the leader", code="not_leader"
            )
        spec = self._spec(body)
        running = self.running(spec["name"])
        if running is not None:
            if running.same_as(spec):
                return 200, running.to_json()
            raise RolloutRefused(
                409,
                f"a rollout of {spec['name']!r} ({running.id}, version {running.version}) is under way",
                param="name",
                code="rollout_in_progress",
            )
        done = next((r for r in reversed(self.items.values()) if r.same_as(spec) and r.status == "completed"), None)
        if done is not None:
            return 200, done.to_json()
        targets = await self._fleet(spec)
        rollout = Rollout(id=f"rollout_{uuid.uuid4().hex[:16]}", targets=targets, **spec)
        if rollout.eval_id is not None:
            await self._check_eval(rollout, body.get("data_source"))
        if self.running(rollout.name) is not None:  # (another request got in while this one awaited)
            raise RolloutRefused(
                409, f"a rollout of {rollout.name!r} is under way", param="name", code="rollout_in_progress"
            )
        self.items[rollout.id] = rollout
        self._save(rollout)
        log.info(
            "rollout %s: %s version %s over %d workers in stages %s",
            rollout.id,
            rollout.name,
            rollout.version,
            len(targets),
            rollout.to_json()["stage_workers"],
        )
        self._run(rollout)
        return 201, rollout.to_json()

    def _spec(self, body: Any) -> dict[str, Any]:
        """The request's fields, checked (400 naming the field at fault)."""
        if not isinstance(body, dict):
            raise RolloutRefused(400, "the body must be a JSON object")
        unknown = sorted(set(body) - set(KEYS))
        if unknown:
            raise RolloutRefused(400, f"unknown field(s) {unknown}; use {', '.join(KEYS)}", param=unknown[0])
        store = body.get("store")
        if not isinstance(store, str) or not store or not Path(store).is_dir():
            raise RolloutRefused(400, f"store {store!r} is not a directory this router can read", param="store")
        name = body.get("name")
        if not isinstance(name, str) or not name or "/" in name or not (Path(store) / name).is_dir():
            raise RolloutRefused(400, f"the store has no adapter {name!r}", param="name", code="adapter_not_found")
        version = _version(Path(store) / name, body.get("version"))
        stages = body.get("stages")
        if (
            not isinstance(stages, list)
            or not stages
            or any(isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1 for f in stages)
            or any(b <= a for a, b in zip(stages, stages[1:], strict=False))
        ):
            raise RolloutRefused(
                400, "stages must be fractions of the fleet, increasing, each in (0, 1]", param="stages"
            )
        eval_id = body.get("eval_id")
        if eval_id is not None and (not isinstance(eval_id, str) or not eval_id):
            raise RolloutRefused(400, "eval_id must be an eval's id", param="eval_id")
        criteria = body.get("criteria", [])
        if (
            not isinstance(criteria, list)
            or not all(isinstance(c, str) for c in criteria)
            or (criteria and not eval_id)
        ):
            raise RolloutRefused(
                400, "criteria must list names of the eval's testing criteria (with eval_id)", param="criteria"
            )
        return {
            "name": name,
            "version": version,
            "store": str(Path(store)),
            "stages": [float(f) for f in stages],
            "eval_id": eval_id,
            "criteria": criteria,
            "min_delta": _number(body, "min_delta", 0.0, -1.0, 1.0),
            "min_pass_rate": _number(body, "min_pass_rate", 0.0, 0.0, 1.0),
            "data_source": None,
            "bake_secs": _number(body, "bake_secs", self.settings.bake_secs, 0.0, 86400.0),
            "max_error_rate": _number(body, "max_error_rate", self.settings.max_error_rate, 0.0, 1.0),
        }

    async def _fleet(self, spec: dict[str, Any]) -> list[Target]:
        """The workers the rollout goes to, each with its stage and the version it serves now."""
        from kiln.adapters.store import read_artifact

        try:
            base = read_artifact(Path(spec["store"]) / spec["name"] / spec["version"]).manifest.base_model.id
        except Exception as e:  # (AdapterNotFound, InvalidAdapter): a version the workers could not load either
            raise RolloutRefused(400, f"version {spec['version']} of {spec['name']!r}: {e}", param="version") from None
        core, found = self.core, []
        for worker in core.fleet():
            url = worker.http_url or (f"http://{worker.endpoint}" if worker.endpoint else "")
            if url and (core.base_model_of(worker) == base or core.lists(worker, spec["name"])):
                found.append((worker, url.rstrip("/")))
        if not found:
            raise RolloutRefused(
                400,
                f"no reachable worker serves {base!r}, the base model of {spec['name']!r}",
                param="name",
                code="no_workers",
            )
        versions = await asyncio.gather(*(self._served_version(url, spec["name"]) for _, url in found))
        counts = [max(1, math.ceil(f * len(found) - 1e-9)) for f in spec["stages"]]
        return [
            Target(
                w.worker_id_str,
                w.worker_id_num,
                url,
                self.core.base_model_of(w),
                next(k for k, n in enumerate(counts, 1) if i < n),
                version,
            )
            for i, ((w, url), version) in enumerate(zip(found, versions, strict=True))
        ]

    async def _served_version(self, url: str, name: str) -> str | None:
        """The version of `name` the worker has loaded (its /v1/adapters), None when none."""
        try:
            reply = await self.client.get(f"{url}/v1/adapters")
            reply.raise_for_status()
            entries = reply.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise RolloutRefused(503, f"{url}/v1/adapters: {e}", code="worker_unavailable") from None
        return next((a.get("version") for a in entries if a.get("name") == name and a.get("loaded")), None)

    async def _check_eval(self, rollout: Rollout, data_source: Any) -> None:
        """Finds the eval on a fleet worker, checks the criteria and settles the runs' data source."""
        evaluation, source = None, None
        for target in rollout.targets:
            reply = await self._call("GET", f"{target.url}/v1/evals/{rollout.eval_id}", quiet=True)
            if reply is not None and reply.status_code == 200:
                evaluation, source = reply.json(), target
                break
        if evaluation is None:
            raise RolloutRefused(
                400, f"no worker of the fleet has eval {rollout.eval_id!r}", param="eval_id", code="eval_not_found"
            )
        names = [c["name"] for c in evaluation["testing_criteria"]]
        if any(c not in names for c in rollout.criteria):
            raise RolloutRefused(400, f"criteria must be some of the eval's: {names}", param="criteria")
        rollout.criteria = rollout.criteria or names
        rollout.eval_source = source.worker
        if data_source is None:
            reply = await self._call("GET", f"{source.url}/v1/evals/{rollout.eval_id}/runs?order=desc&limit=100")
            runs = reply.json()["data"] if reply is not None and reply.status_code == 200 else []
            data_source = next(
                (
                    r["data_source"]
                    for r in runs
                    if r["status"] == "completed" and r["data_source"].get("type") in ("completions", "responses")
                ),
                None,
            )
            if data_source is None:
                raise RolloutRefused(
                    400,
                    f"eval {rollout.eval_id} has no completed run that sampled to take the "
                    "items from; give data_source",
                    param="eval_id",
                )
        if not isinstance(data_source, dict) or data_source.get("type", "completions") not in (
            "completions",
            "responses",
        ):
            raise RolloutRefused(400, "data_source must be a completions or responses data source", param="data_source")
        source_of_items = data_source.get("source") or {}
        if source_of_items.get("type") == "file_id":  # inline, so that any worker can run it
            reply = await self._call("GET", f"{source.url}/v1/files/{source_of_items.get('id')}/content")
            if reply is None or reply.status_code != 200:
                raise RolloutRefused(
                    400, f"the data source's file {source_of_items.get('id')!r} cannot be read", param="data_source"
                )
            rows = [json.loads(line) for line in reply.text.splitlines() if line.strip()]
            data_source = {**data_source, "source": {"type": "file_content", "content": rows}}
        rollout.data_source = {k: v for k, v in data_source.items() if k != "model"}

    # ---- running --------------------------------------------------------------------------------

    def _run(self, rollout: Rollout) -> None:
        task = asyncio.create_task(self._drive(rollout), name=f"rollout-{rollout.id}")
        self.tasks[rollout.id] = task
        task.add_done_callback(lambda _: self.tasks.pop(rollout.id, None))

    async def _drive(self, rollout: Rollout) -> None:
        try:
            if rollout.status == "running":
                try:
                    for stage in range(max(rollout.stage, 1), len(rollout.stages) + 1):
                        await self._stage(rollout, stage)
                except CheckFailed as e:
                    rollout.status, rollout.reason = "rolling_back", str(e)
                    log.warning("rollout %s of %s: %s; rolling back", rollout.id, rollout.name, e)
                    self._save(rollout)
                else:
                    await self._settle(rollout)
                    rollout.status = "completed"
                    self._save(rollout)
                    log.info(
                        "rollout %s: %s version %s serves on %d workers",
                        rollout.id,
                        rollout.name,
                        rollout.version,
                        len(rollout.targets),
                    )
                    return
            await self._roll_back(rollout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or an unreachable store: say so, leave what is loaded as it is
            rollout.status, rollout.reason = "failed", f"{rollout.reason + '; ' if rollout.reason else ''}{e}"
            log.exception("rollout %s of %s failed", rollout.id, rollout.name)
            self._save(rollout)
        finally:
            self.window.pop(rollout.id, None)
            self.picks = {rid: pick for rid, pick in self.picks.items() if pick[0] != rollout.id}

    async def _stage(self, rollout: Rollout, stage: int) -> None:
        rollout.stage = stage
        self._save(rollout)
        new = [t for t in rollout.targets if t.stage == stage]
        check: dict[str, Any] = {"stage": stage, "workers": [t.worker for t in new], "started_at": time.time()}
        host = new[0]
        baseline = None
        if rollout.eval_id is not None:
            model = rollout.name if host.previous is not None and host.state != "serving" else host.base_model
            baseline = await self._eval_run(rollout, host, model, f"stage {stage} baseline")
        self.window[rollout.id] = {}
        for target in new:
            await self._load(rollout, target)
        bake_until = time.monotonic() + rollout.bake_secs
        reasons = []
        if baseline is not None:
            candidate = await self._eval_run(rollout, host, rollout.name, f"stage {stage} candidate")
            check["eval"] = await self._judge(rollout, host, baseline, candidate)
            reasons += [f"eval on {host.worker}: {r}" for r in check["eval"]["reasons"]]
        await asyncio.sleep(max(0.0, bake_until - time.monotonic()))
        check["error_rates"], failing = self._error_rates(rollout)
        reasons += failing
        check["passed"], check["reasons"], check["ended_at"] = not reasons, reasons, time.time()
        rollout.checks.append(check)
        self._save(rollout)
        if reasons:
            raise CheckFailed(f"stage {stage}: " + "; ".join(reasons))
        log.info(
            "rollout %s of %s: stage %d passed (%d workers)",
            rollout.id,
            rollout.name,
            stage,
            sum(1 for t in rollout.targets if t.stage <= stage),
        )

    async def _load(self, rollout: Rollout, target: Target) -> None:
        if target.state == "serving":
            return
        target.state = "loading"
        self._save(rollout)
        if await self._served_version_or_none(target, rollout.name) != rollout.version:
            reply = await self._call(
                "POST",
                f"{target.url}/v1/adapters",
                timeout=LOAD_TIMEOUT_S,
                json={"name": rollout.name, "path": rollout.path, "replace": True},
            )
            if reply is None or reply.status_code != 200:
                raise CheckFailed(f"{target.worker} could not load version {rollout.version}: {_said(reply)}")
        target.state = "serving"
        self._save(rollout)

    async def _served_version_or_none(self, target: Target, name: str) -> str | None:
        try:
            return await self._served_version(target.url, name)
        except RolloutRefused:
            return None

    def _error_rates(self, rollout: Rollout) -> tuple[dict[str, Any], list[str]]:
        """Per touched worker: the requests for the adapter answered and failed since the stage's loads."""
        window, view, reasons = self.window.get(rollout.id, {}), {}, []
        for target in rollout.targets:
            if target.state != "serving":
                continue
            answered, failed = window.get(target.worker_id_num, [0, 0])
            view[target.worker] = {"answered": answered, "failed": failed}
            why = self.core.why_ineligible(target.worker_id_num)
            if why is not None:
                reasons.append(f"{target.worker} is {why}")
            elif failed and failed / answered > rollout.max_error_rate:
                reasons.append(
                    f"{target.worker}: {failed} of {answered} requests for {rollout.name} failed "
                    f"(max_error_rate {rollout.max_error_rate:g})"
                )
        return view, reasons

    async def _roll_back(self, rollout: Rollout) -> None:
        """Every touched worker back to what it served before, the last touched first."""
        touched = [t for t in reversed(rollout.targets) if t.state not in ("waiting", "restored")]
        for target in touched:
            if target.previous is None:
                target.state = "draining"  # off the adapter's picks first, then unloaded
                self._save(rollout)
                await asyncio.sleep(self.settings.drain_secs)
                reply = await self._call("DELETE", f"{target.url}/v1/adapters/{rollout.name}", timeout=LOAD_TIMEOUT_S)
                ok = reply is not None and reply.status_code in (200, 404)
            else:
                target.state = "restoring"
                self._save(rollout)
                path = str(Path(rollout.store) / rollout.name / target.previous)
                reply = await self._call(
                    "POST",
                    f"{target.url}/v1/adapters",
                    timeout=LOAD_TIMEOUT_S,
                    json={"name": rollout.name, "path": path, "replace": True},
                )
                ok = reply is not None and reply.status_code == 200
            if not ok:
                raise RuntimeError(f"rolling back {target.worker} failed: {_said(reply)}")
            target.state = "restored"
            self._save(rollout)
        await self._settle(rollout)
        rollout.status = "rolled_back"
        self._save(rollout)
        log.info("rollout %s of %s rolled back on %d workers", rollout.id, rollout.name, len(touched))

    async def _settle(self, rollout: Rollout) -> None:
        """Reads the touched workers' /v1/models now, and keeps steering picks a little longer, so that
        picking by what the workers list resumes on what they list after the rollout."""
        self.ended[rollout.name] = (rollout, time.monotonic())
        scraper = self.core.scraper
        if scraper is not None:
            touched = [t.worker_id_num for t in rollout.targets if t.state != "waiting"]
            with contextlib.suppress(KeyError):
                await asyncio.gather(*(scraper.scrape_now(num) for num in touched))
        self.ended[rollout.name] = (rollout, time.monotonic())

    # ---- evals ----------------------------------------------------------------------------------

    async def _eval_on(self, rollout: Rollout, host: Target) -> str:
        """The eval's id on `host`: the eval itself on the worker it was found on, else a copy."""
        if host.worker == rollout.eval_source:
            return rollout.eval_id
        if host.worker in rollout.eval_copies:
            return rollout.eval_copies[host.worker]
        source = next(t for t in rollout.targets if t.worker == rollout.eval_source)
        reply = await self._call("GET", f"{source.url}/v1/evals/{rollout.eval_id}")
        if reply is None or reply.status_code != 200:
            raise CheckFailed(f"eval {rollout.eval_id} cannot be read from {source.worker}: {_said(reply)}")
        original = reply.json()
        schema = original["data_source_config"].get("schema") or {}  # (as a retrieve shows it: item and sample)
        config = {
            "type": "custom",
            "item_schema": schema.get("properties", {}).get("item", {"type": "object"}),
            "include_sample_schema": "sample" in schema.get("properties", {}),
        }
        copy = {
            "name": f"{original.get('name') or rollout.eval_id} (rollout {rollout.id})",
            "data_source_config": config,
            "testing_criteria": original["testing_criteria"],
            "metadata": {"kiln_rollout": rollout.id, "kiln_copy_of": rollout.eval_id},
        }
        reply = await self._call("POST", f"{host.url}/v1/evals", json=copy)
        if reply is None or reply.status_code != 200:
            raise CheckFailed(f"eval {rollout.eval_id} cannot be copied to {host.worker}: {_said(reply)}")
        rollout.eval_copies[host.worker] = reply.json()["id"]
        self._save(rollout)
        return rollout.eval_copies[host.worker]

    async def _eval_run(self, rollout: Rollout, host: Target, model: str, role: str) -> str:
        eval_id = await self._eval_on(rollout, host)
        body = {
            "name": f"rollout {rollout.id} {role}",
            "metadata": {"kiln_rollout": rollout.id, "kiln_role": role},
            "data_source": {**rollout.data_source, "model": model},
        }
        reply = await self._call("POST", f"{host.url}/v1/evals/{eval_id}/runs", json=body)
        if reply is None or reply.status_code != 200:
            raise CheckFailed(f"the {role} run of eval {eval_id} on {host.worker} could not start: {_said(reply)}")
        return reply.json()["id"]

    async def _judge(self, rollout: Rollout, host: Target, baseline: str, candidate: str) -> dict[str, Any]:
        from kiln.eval.comparison import judge

        eval_id = await self._eval_on(rollout, host)
        result = {"worker": host.worker, "eval_id": eval_id, "baseline_run": baseline, "candidate_run": candidate}
        broken = []
        for role, run_id in (("baseline", baseline), ("candidate", candidate)):
            run = await self._finished(host, eval_id, run_id)
            if run.get("status") != "completed":
                broken.append(f"the {role} run {run_id} {run.get('status')}")
        if broken:
            return {**result, "passed": False, "reasons": broken, "criteria": []}
        reply = await self._call("GET", f"{host.url}/v1/evals/{eval_id}/compare?runs={baseline},{candidate}")
        if reply is None or reply.status_code != 200:
            return {
                **result,
                "passed": False,
                "reasons": [f"the runs cannot be compared: {_said(reply)}"],
                "criteria": [],
            }
        reasons, rows = judge(reply.json(), rollout.criteria, rollout.min_pass_rate, rollout.min_delta)
        return {**result, "passed": not reasons, "reasons": reasons, "criteria": rows}

    async def _finished(self, host: Target, eval_id: str, run_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + EVAL_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = await self._call("GET", f"{host.url}/v1/evals/{eval_id}/runs/{run_id}", quiet=True)
            if (
                reply is not None
                and reply.status_code == 200
                and reply.json()["status"] not in ("queued", "in_progress")
            ):
                return reply.json()
            await asyncio.sleep(EVAL_POLL_S)
        return {"status": "timed out"}

    async def _call(self, method: str, url: str, quiet: bool = False, **kwargs: Any) -> httpx.Response | None:
        """One request to a worker; None when it could not be made."""
        try:
            return await self.client.request(method, url, **kwargs)
        except httpx.HTTPError as e:
            if not quiet:
                log.warning("rollout: %s %s: %s", method, url, e)
            return None


def _version(adapter_dir: Path, version: Any) -> str:
    """The store's directory name for `version` (an integer, or its digits)."""
    digits = str(version) if isinstance(version, int) and not isinstance(version, bool) else version
    if isinstance(digits, str) and digits.isdigit():
        for p in adapter_dir.iterdir():
            if p.name.isdigit() and int(p.name) == int(digits) and (p / "manifest.json").exists():
                return p.name
    raise RolloutRefused(
        400,
        f"the store has no version {version!r} of {adapter_dir.name!r}",
        param="version",
        code="adapter_version_not_found",
    )


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    from kiln.eval.comparison import threshold

    value = body.get(key, default)
    if (number := threshold(value, lo, hi)) is None:
        raise RolloutRefused(400, f"{key} must be a number from {lo:g} to {hi:g}, got {value!r}", param=key)
    return number


def _said(reply: httpx.Response | None) -> str:
    if reply is None:
        return "no answer"
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text[:200]
    return f"{reply.status_code} {message}"
