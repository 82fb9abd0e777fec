"""Fine-tuning jobs in the serving process, in OpenAI's shapes (`fine_tuning.job`, its events
and checkpoints), durable across restarts.

One worker thread runs one job at a time; the others wait in the queue. Each training
micro-step is a writer under the engine's accelerator ownership, so it runs at an iteration
boundary and serving continues between steps; compiling a step happens outside ownership.
A job checkpoints (orbax) every `checkpoint_every` optimizer steps, on pause and on shutdown;
after a restart a job that was running resumes from its last checkpoint. A finished job
saves its adapter to the store and, unless `auto_load` is false, loads it for serving.

A job is three things: its `JobSpec` (kiln.train.job_request: checked once in `create`, read
back from the stored job), the worker here (queue, lifecycle, one cancel path), and its training
run (see kiln.train.run), which each method builds for itself (`_RUNS`). How a job shares the
accelerator with serving is kiln.train.serving_share.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import shutil
import threading
import time
from pathlib import Path

import jax
import msgspec

from kiln.engine.faults import as_device_lost, is_device_loss
from kiln.engine.lora_slots import AdapterWeights
from kiln.errors import InvalidRequest, KilnError, NotFound
from kiln.eval.gate import Gate, GateResult, GateSpec, GateStopped
from kiln.train.agent_grpo import AgentGRPORun
from kiln.train.grpo import GRPORun, as_reward
from kiln.train.job_request import JobRequests, JobSpec
from kiln.train.opd import OPDRun
from kiln.train.run import TrainingRun, advance_to_end
from kiln.train.serving_share import ServingShare
from kiln.train.sft import SFTRun
from kiln.train.slices import StepAbandoned
from kiln.train.store import TrainingStore, new_id, now
from kiln.train.tensorboard import TensorBoard, job_log_dir

log = logging.getLogger("kiln.train")

ACTIVE = ("validating_files", "queued", "running")
FINAL = ("succeeded", "failed", "cancelled")


class SubmittedRolloutsRun(GRPORun):
    """A reinforcement job's run on rollouts a client samples and scores (`kiln.rollouts =
    "external"`): each `advance` trains on the next submitted batch, or returns None after a
    short wait when none is waiting. take(): the next (groups, final, future), or None."""

    def __init__(self, *args, take, **kwargs):
        super().__init__(*args, **kwargs)
        self._take = take

    def advance(self, ownership=None) -> dict | None:
        submission = self._take()
        if submission is None:
            return None
        groups, final, future = submission
        try:
            started = time.perf_counter()
            metrics = self.train_step(groups, ownership)
            metrics.update(step=self.step, train_seconds=time.perf_counter() - started)
        except StepAbandoned as exc:  # the job stopped between two slices: the batch is not trained on
            future.set_exception(exc)
            return None
        except Exception as exc:
            future.set_exception(exc)
            raise
        if final:
            self.total_steps = self.step
        future.set_result({"object": "fine_tuning.job.rollouts", "step": self.step, "final": final or self.done,
                           "metrics": metrics})
        return metrics

    def summary(self, metrics: dict) -> str:
        return f"reward={metrics['reward_mean']:.4f} (submitted)"


class JobManager:
    def __init__(self, settings, engine, registry, store: TrainingStore, start: bool = True, evals=None):
        """evals: the EvalService that promotion gates run on (jobs without a gate need none)."""
        self.settings, self.engine, self.registry, self.store = settings, engine, registry, store
        self.model = engine.model
        self._cv = threading.Condition()
        self._flags: dict[str, str] = {}  # job id -> "cancel" | "pause"
        self._submissions: dict[str, list] = {}  # job id -> scored rollouts waiting for a step
        self._stopping = False
        self.current: str | None = None
        self.share = ServingShare(settings, engine)
        self.requests = JobRequests(settings, engine, registry, store, self.share, evals)
        if settings.train.data_parallel != 1:
            log.warning("train.data_parallel = %s is for in-process runs (kiln train); this server's fine-tuning "
                        "jobs train on its serving mesh (engine.tensor_parallel)", settings.train.data_parallel)
        for job in store.list_jobs(ACTIVE):  # a restart: running jobs resume from their checkpoints
            if job["status"] == "running":
                store.add_event(job["id"], "Kiln restarted; the job resumes from its last checkpoint")
            self._set(job, status="queued")
        self._thread = threading.Thread(target=self._worker, name="kiln-train", daemon=True)
        if start:
            self._thread.start()

    @property
    def evals(self):
        """The EvalService that promotion gates run on (None: a job cannot have a gate)."""
        return self.requests.evals

    @evals.setter
    def evals(self, service) -> None:  # set once the service exists: it reads this manager's store
        self.requests.evals = service

    def start(self) -> None:
        """Starts the worker (for a manager made with start=False)."""
        self._thread.start()

    # ---- API -------------------------------------------------------------------------------

    def create(self, body: dict) -> dict:
        """Checks a job request (a 400 on any problem, nothing stored; see JobRequests) and queues it."""
        if (processes := jax.process_count()) > 1:  # a job resizes the KV pool and trains in process 0 alone
            raise InvalidRequest(f"fine-tuning jobs run on a server of one process; this one spans {processes} "
                                 "processes (`kiln train` trains over several)", code="multi_process_server")
        job = self.requests.check(body)
        self.store.put_job(job)
        self.store.add_event(job["id"], f"Validated training file: {job['training_file']}")
        self.store.add_event(job["id"], "Fine-tuning job queued")
        with self._cv:
            self._cv.notify_all()
        return job

    def get(self, job_id: str) -> dict:
        job = self.store.get_job(job_id)
        if job is None:
            raise NotFound(f"no fine-tuning job {job_id!r}", code="job_not_found", param="fine_tuning_job_id")
        return job

    def list(self, after: str | None = None, limit: int = 20) -> tuple[list[dict], bool]:
        jobs = self.store.list_jobs()
        if after:
            ids = [j["id"] for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        return jobs[:limit], len(jobs) > limit

    def cancel(self, job_id: str) -> dict:
        return self._control(job_id, "cancel")

    def pause(self, job_id: str) -> dict:
        return self._control(job_id, "pause")

    def resume(self, job_id: str) -> dict:
        with self._cv:
            job = self.get(job_id)
            if job["status"] != "paused":
                raise InvalidRequest(f"job {job_id} is {job['status']}, not paused", code="invalid_job_state")
            self._set(job, status="queued")
            self.store.add_event(job_id, "Fine-tuning job resumed")
            self._cv.notify_all()
        return self.get(job_id)

    def shutdown(self) -> None:
        """Stops the worker; a running job checkpoints and resumes when Kiln starts again."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=600)

    def snapshot(self) -> dict:
        """Jobs now: the running one (with its planned bytes) and the queue, oldest first."""
        queued = [j["id"] for j in reversed(self.store.list_jobs(("queued",)))]
        running = self.store.get_job(self.current) if self.current else None
        training_bytes = 0
        if running:
            plan = running["kiln"]["plan"]
            training_bytes = plan["required_bytes_remat" if plan["remat"] else "required_bytes"]
        return {"running": running["id"] if running else None, "queued": queued, "training_bytes": training_bytes}

    # ---- internals ---------------------------------------------------------------------------

    def _set(self, job: dict, **changes) -> dict:
        job.update(changes)
        self.store.put_job(job)
        return job

    def _control(self, job_id: str, action: str) -> dict:
        with self._cv:
            job = self.get(job_id)
            if job["status"] in FINAL:
                raise InvalidRequest(f"job {job_id} has already {job['status']}", code="invalid_job_state")
            if job["status"] == "running" or job_id == self.current:
                self._flags[job_id] = action  # the worker acts at the next step boundary
            elif action == "cancel":
                self._cancelled(job, "Fine-tuning job cancelled")  # a paused job's checkpoints go too
            elif job["status"] == "queued":
                self._set(job, status="paused")
                self.store.add_event(job_id, "Fine-tuning job paused")
        return self.get(job_id)

    def _cancelled(self, job: dict, message: str) -> None:
        """The one way a job ends cancelled: its status, the event, its checkpoints removed."""
        self._set(job, status="cancelled", finished_at=now())
        self.store.add_event(job["id"], message)
        self._remove_checkpoints(job["id"])

    def _interrupted(self, job_id: str, action: str | None = None) -> bool:
        """Whether a shutdown, or a control (`action`, or any), waits for the job."""
        with self._cv:
            return self._stopping or (job_id in self._flags if action is None else self._flags.get(job_id) == action)

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.store.list_jobs(("queued",)):
                    self._cv.wait(timeout=5)
                if self._stopping:
                    return
                job = self.store.list_jobs(("queued",))[-1]  # oldest first
                self.current = job["id"]
            try:
                self._run(job)
            except KilnError as exc:
                self._fail(job, exc.code or "job_failed", exc.message)
            except Exception as exc:  # a bug or a device failure: the job fails, the worker lives
                log.exception("fine-tuning job %s failed", job["id"])
                if is_device_loss(exc):  # the process serves nothing more either
                    self.engine.report_device_loss(exc)
                    self._fail(job, "device_lost", as_device_lost(exc).message)
                else:
                    self._fail(job, "internal_error", f"{type(exc).__name__}: {exc}")
            finally:
                self.current = None
                self._reclaim()

    def _reclaim(self) -> None:
        """Allocator reclaim after a job: its params, optimizer state and compiled steps are
        dropped with the run; on the CPU, glibc then returns the freed heap to the system."""
        import ctypes
        import gc

        with self.engine.ownership.write("allocator reclaim"):
            gc.collect()
            if jax.default_backend() == "cpu":
                try:
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                except (OSError, AttributeError):  # not glibc
                    pass

    def _fail(self, job: dict, code: str, message: str) -> None:
        self._set(job, status="failed", finished_at=now(), error={"code": code, "message": message, "param": None})
        self.store.add_event(job["id"], f"Fine-tuning job failed: {message}", level="error")

    def _job_dir(self, job_id: str) -> Path:
        """A job's own directory: its checkpoints while it runs, its TensorBoard event files."""
        return self.store.root / "jobs" / job_id

    def _checkpoint_dir(self, job_id: str) -> Path:
        return self._job_dir(job_id) / "checkpoints"

    def _remove_checkpoints(self, job_id: str) -> None:
        """A job's checkpoints, and its directory when nothing else (event files) is left there."""
        shutil.rmtree(self._checkpoint_dir(job_id), ignore_errors=True)
        try:
            self._job_dir(job_id).rmdir()
        except OSError:  # not empty, or never made
            pass

    def _run(self, job: dict) -> None:
        import orbax.checkpoint as ocp

        job_id, spec = job["id"], JobSpec.from_job(job)
        event = functools.partial(self.store.add_event, job_id)
        run = self._make_run(spec)
        manager = ocp.CheckpointManager(self._checkpoint_dir(job_id).absolute(),
                                        options=ocp.CheckpointManagerOptions(max_to_keep=2))
        shrunk, board = False, TensorBoard(None)
        try:
            if spec.kv_resize_to:
                shrunk = self.share.shrink_kv(spec.kv_resize_to, lambda: self._interrupted(job_id), event)
            if manager.latest_step() is not None:
                run.restore(manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(run.state())))
                self.store.add_event(job_id, f"Resumed from the checkpoint at step {run.step}")
            # an earlier attempt's points after the checkpoint are hidden: its steps are taken again
            board = TensorBoard(job_log_dir(self.settings, self._job_dir(job_id), job_id), purge_step=run.step + 1)
            job["kiln"]["total_steps"] = run.total_steps
            self._set(job, status="running")
            self.store.add_event(job_id, "Fine-tuning job started")
            if not self._train(job, spec, run, manager, board):
                return
            if shrunk:  # before the job reads as finished
                self.share.grow_kv(event)
                shrunk = False
            if spec.gate and not self._finish_gated(job, run, manager, board):
                return
            if not spec.gate:
                self._finish(job, run, board)
        finally:
            board.close()
            manager.close()
            with self._cv:  # submitted rollouts the job will not take
                for _, _, future in self._submissions.pop(job_id, []):
                    future.set_exception(InvalidRequest(f"job {job_id} stopped before taking these rollouts",
                                                        code="job_not_active", param="fine_tuning_job_id"))
            run.close()
            if shrunk:
                self.share.grow_kv(event)

    def _train(self, job: dict, spec: JobSpec, run: TrainingRun, manager, board: TensorBoard) -> bool:
        """Advances the run to its end, a step at a time between serving steps, acting on a
        cancel, pause or shutdown at each boundary, each step's metrics an event and TensorBoard
        points; False if one stopped it."""
        job_id = job["id"]

        def stop() -> bool:
            with self._cv:
                action = self._flags.pop(job_id, None)
                stopping = self._stopping
            if action == "cancel":
                self._cancelled(job, "Fine-tuning job cancelled")
                return True
            if action == "pause" or stopping:
                self._save_checkpoint(manager, run, job, None)
                if action == "pause":
                    self._set(job, status="paused")
                    self.store.add_event(job_id, f"Fine-tuning job paused at step {run.step}")
                return True  # on shutdown the job stays running: it resumes at the next start
            return False

        def on_step(metrics: dict) -> None:
            job["kiln"]["step"] = metrics["step"]
            self._set(job, trained_tokens=run.trained_tokens)
            self.store.add_event(job_id, f"Step {metrics['step']}/{run.total_steps}: {run.summary(metrics)}",
                                 type_="metrics", data={**metrics, "total_steps": run.total_steps})
            board.step(metrics)
            if run.step % spec.checkpoint_every == 0 and not run.done:
                self._save_checkpoint(manager, run, job, metrics)

        # (advance compiles outside ownership, then takes it a slice at a time, taking turns with serving)
        return advance_to_end(run, self.engine.ownership, stop=stop, on_step=on_step,
                              share=self.settings.train.serving_share)

    def _make_run(self, spec: JobSpec) -> TrainingRun:
        """The job's run: each method builds its own (`_RUNS`)."""
        return _RUNS[spec.method](self, spec)

    def _input(self, spec: JobSpec, purpose: str, read):
        """A job's training or validation data through `read(file, param)`; None without it."""
        file_id = spec.inputs.get(purpose)
        return read(self.store.get_file(file_id), f"{purpose}_file") if file_id else None

    def _sft_run(self, spec: JobSpec) -> SFTRun:
        def read(file, param):
            return self.requests.examples(file, spec.config, param)

        return SFTRun(self.model.params, self.model.config, self._input(spec, "training", read), spec.config,
                      self._input(spec, "validation", read), remat=spec.remat, name=spec.id, mesh=self.engine.mesh)

    def _policy_run(self, spec: JobSpec, make) -> GRPORun:
        """A GRPO or distillation run: make(ids, items, name) on the job's prompts; the
        validation prompts are what a reinforcement run's reward is measured on."""
        def read(file, param):
            return self.requests.prompts(file, spec.max_seq_len, param)

        prompts = self._input(spec, "training", read)
        run = make([p.ids for p in prompts], [p.item for p in prompts], f"{spec.adapter_name}:training")
        run.validation = self._input(spec, "validation", read)
        run.eval_interval, run.eval_samples = spec.eval_interval, spec.eval_samples
        return run

    def _grpo_run(self, spec: JobSpec) -> GRPORun:
        cls, extra = ((SubmittedRolloutsRun, {"take": lambda: self._take_submission(spec.id)})
                      if spec.rollouts == "external" else (GRPORun, {}))

        def make(ids, items, name):
            reward = as_reward(spec.grader, self.judge) if spec.grader is not None else None
            if spec.agent is not None:  # the grader sees each episode's answer, calls and output items
                fields = {k: v for k, v in spec.agent.items() if k != "tools"}
                return AgentGRPORun(self.engine, items, spec.agent["tools"], spec.config, reward=reward, name=name,
                                    fields={**fields, "mcp_commands": self.settings.server.mcp_commands})
            return cls(self.engine, ids, items, reward, spec.config, name=name, **extra)

        return self._policy_run(spec, make)

    def _opd_run(self, spec: JobSpec) -> OPDRun:
        def make(ids, items, name):
            teacher = self.requests.teacher(spec.teacher, "method.distillation.teacher")
            return OPDRun(self.engine, ids, teacher, spec.config, name=name, items=items)

        return self._policy_run(spec, make)

    def submit_rollouts(self, job_id: str, body: dict, timeout: float = 600.0) -> dict:
        """Scored rollouts for a reinforcement job with `kiln.rollouts = "external"`: one training
        step on them, taken by the job at its next step; returns the step's metrics. `final`
        ends the job after this step (its adapter is saved as usual)."""
        job = self.get(job_id)
        if job["kiln"].get("rollouts") != "external":
            raise InvalidRequest(f"job {job_id} samples its own rollouts; scored rollouts go to a reinforcement job "
                                 "created with kiln.rollouts = \"external\"", param="fine_tuning_job_id")
        if job["status"] not in ("queued", "running"):
            raise InvalidRequest(f"job {job_id} is {job['status']}", code="job_not_active", param="fine_tuning_job_id")
        groups = body.get("groups")
        if not isinstance(groups, list) or not groups:
            raise InvalidRequest("groups must be a non-empty list", param="groups")
        parsed = [self.requests.scored_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._submissions.setdefault(job_id, []).append((parsed, bool(body.get("final")), future))
            self._cv.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise InvalidRequest(f"job {job_id} did not take the rollouts within {timeout:.0f} s",
                                 code="job_busy", param="fine_tuning_job_id") from None

    def _take_submission(self, job_id: str):
        """The next submitted batch of scored rollouts (groups, final, future); None after a
        short wait while none waits."""
        with self._cv:
            waiting = self._submissions.get(job_id)
            if not waiting:
                self._cv.wait(timeout=0.5)
                return None
            return waiting.pop(0)

    def judge(self, model: str, messages: list[dict], params: dict):
        """Model graders' judge: a model this process serves, the base or a loaded adapter."""
        from kiln.graders.engine_judge import engine_judge

        def adapter_weights(name: str):
            if name in (None, "", self.model.model_id):
                return None
            adapter = self.registry.get(name)
            if adapter is None:
                raise NotFound(f"The model `{name}` does not exist.", code="model_not_found", param="model")
            return adapter.weights

        return engine_judge(self.engine, adapter_weights)(model, messages, params)

    def _save_checkpoint(self, manager, run, job: dict, metrics: dict | None) -> None:
        import orbax.checkpoint as ocp

        with self.engine.ownership.write(f"checkpoint {job['id']}"):
            manager.save(run.micro_step, args=ocp.args.StandardSave(run.state()), force=True)
            manager.wait_until_finished()
        if metrics is not None:
            name = job["kiln"]["adapter_name"]
            self.store.add_checkpoint(job["id"], {
                "id": new_id("ftckpt"), "object": "fine_tuning.job.checkpoint", "created_at": now(),
                "fine_tuned_model_checkpoint": f"{name}:step-{run.step}", "fine_tuning_job_id": job["id"],
                "step_number": run.step,
                "metrics": {k: float(metrics[k]) for k in ("train_loss", "train_mean_token_accuracy", "valid_loss",
                                                           "valid_mean_token_accuracy", "reward_mean",
                                                           "valid_reward_mean", "reverse_kl") if k in metrics}
                | {"step": float(run.step)}})
            self.store.add_event(job["id"], f"Checkpoint created at step {run.step}")

    def _finish_gated(self, job: dict, run, manager, board: TensorBoard) -> bool:
        """The gate, then the finish; False if a cancel or a shutdown stopped the gate. The final
        state is checkpointed first, so a restart resumes straight at the gate."""
        job_id = job["id"]
        if manager.latest_step() != run.micro_step:
            self._save_checkpoint(manager, run, job, None)

        try:
            self._finish(job, run, board, lambda: self._interrupted(job_id, "cancel"))
        except GateStopped:
            with self._cv:
                cancelled = self._flags.pop(job_id, None) == "cancel"
            if cancelled:
                self._cancelled(job, "Fine-tuning job cancelled during its gate")
            return False
        return True

    def _run_gate(self, job: dict, manifest, weights, stopped) -> GateResult:
        spec = job["kiln"]
        if not self.settings.serving_profile.policy.inference_admission:  # resumed into maintenance
            return GateResult(False, ["the maintenance serving profile admits no evaluation"], None, None, [])
        candidate = AdapterWeights(spec["adapter_name"], f"gate-{job['id']}", weights, manifest.scale, manifest.rank)
        gate = Gate(GateSpec.from_json(spec["gate"]), self.evals, self.model.model_id, job["id"])
        try:
            return gate.evaluate(spec["adapter_name"], candidate, stopped,
                                 lambda message: self.store.add_event(job["id"], message))
        finally:
            self.engine.retire_adapter(candidate).result()  # its slot frees once its requests end

    def _finish(self, job: dict, run, board: TensorBoard, stopped=lambda: False) -> None:
        """Saves the adapter (after the gate, if any: its numbers go to `board` too), loads it unless
        the gate failed or auto_load is off, and ends the job succeeded, its event files closed."""
        spec = job["kiln"]
        inputs = [{"purpose": purpose, "file_id": job[f"{purpose}_file"],
                   "sha256": self.store.get_file(job[f"{purpose}_file"])["sha256"]}  # digested at upload
                  for purpose in ("training", "validation") if job[f"{purpose}_file"]]
        manifest = run.manifest(spec["adapter_name"], self.model, inputs,
                                {"job_id": job["id"], "started_at": job["created_at"], "finished_at": now()})
        weights = run.weights()
        gate = None
        if spec["gate"]:
            gate = self._run_gate(job, manifest, weights, stopped)
            spec["gate_result"] = gate.to_json()
            board.gate(spec["gate_result"], run.step)
            manifest = msgspec.structs.replace(manifest, eval_results={
                **(manifest.eval_results or {}), "gate": {**spec["gate"], **gate.to_json()}})
        artifact = self.registry.store.save(manifest, weights)
        self.store.add_event(job["id"], f"New fine-tuned model created: {artifact.name} (version {artifact.version})")
        if gate is not None and gate.passed:
            self.store.add_event(job["id"], f"Gate passed on eval {spec['gate']['eval_id']}")
        elif gate is not None:
            self.store.add_event(job["id"], f"Gate failed: {'; '.join(gate.reasons)}. The adapter {artifact.name} "
                                            "stays in the store and is not loaded", level="warn")
        if spec["auto_load"] and (gate is None or gate.passed):
            self.registry.load(artifact.name, replace=self.registry.get(artifact.name) is not None)
            self.store.add_event(job["id"], f"Adapter {artifact.name} loaded for serving")
        self._remove_checkpoints(job["id"])
        board.close()  # every point is on disk once the job reads as succeeded
        with self._cv:
            self._flags.pop(job["id"], None)  # a pause asked for during the gate comes too late
        self._set(job, status="succeeded", finished_at=now(), fine_tuned_model=artifact.name,
                  trained_tokens=run.trained_tokens)
        self.store.add_event(job["id"], "The job has successfully completed")


_RUNS = {"supervised": JobManager._sft_run, "reinforcement": JobManager._grpo_run,
         "distillation": JobManager._opd_run}
