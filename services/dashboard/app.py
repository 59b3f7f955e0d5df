"""The dashboard: one page that shows the cluster live, and a few controls.

The server folds the log itself (the same fold every service runs, so it is right even while
Redis or the projector is down). A page loads the whole model once with its version, then gets
what changed over Server-Sent Events, at most a few times a second, as deltas keyed by version
(`delta.py`; at 1,000 nodes a grant is ~5 kB where the whole model is ~2 MB). Documents come from `gpusched.readmodel`, explanations
from `policy.explain` under the running policy (`--policy`, as the reader's `show` takes it).
Controls go through the control plane: submitting and flooding through admission
(request/reply), stopping and starting placement through the supervisor's control subject
(`gpusched.ctl.placement`, see `control.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.resources
import json
import time
import uuid
from collections import deque
from typing import Any

import msgspec
import structlog
from aiohttp import web

from gpusched import metrics, readmodel, telemetry
from gpusched.bus.log import EventLog, Record
from gpusched.core.model import JobSpec, TopologyConstraint
from gpusched.core.state import ClusterState
from gpusched.policy.config import DEFAULT, PolicyConfig
from gpusched.services.runtime import ExplainIndexes, FoldedLog, notify_ready
from gpusched.services.shell import policy_arguments, policy_of

from . import control
from .delta import SERIES, Versions
from .guard import GUARD, Guard, api_session, guard_middleware

log = structlog.get_logger()

TAIL = SERIES["tail"][1]
FINISHED_SHOWN = 40
QUEUE_SHOWN = 300
PUSH_MIN_INTERVAL_S = 0.25  # at most 4 pushes a second per page



def _accounted(doc: dict[str, Any], now: float) -> dict[str, Any]:
    """A job or team document with its GPU-hours held and busy and its efficiency."""
    return {**doc, **readmodel.accounting(doc, now)}

def page_model(state: ClusterState, version: int, lease: dict[str, Any], shares: list[dict[str, Any]],
               tail: list[dict[str, Any]]) -> dict[str, Any]:
    """The page's whole model at `version`: nodes in natural order (rack2 < rack10), jobs as plain
    documents (the page extrapolates their GPU-hours from `gpu_s`, see `delta`)."""
    nodes = [readmodel.node_doc(state, name) for name in sorted(state.nodes, key=readmodel.natural_key)]
    finished = [j for j in state.jobs.values() if j.state in ("completed", "failed", "cancelled", "timeout")]
    finished.sort(key=lambda j: (j.finished_at or 0.0), reverse=True)
    queue = readmodel.queue_docs(state)
    health = readmodel.health_doc(state)
    health["lease"] = lease
    return {
        "version": version,
        "seq": state.last_seq,
        "now": state.now,
        "served_at": time.time(),
        "health": health,
        "teams": [_accounted(readmodel.team_doc(state, t), state.now) for t in sorted(state.teams)],
        "nodes": nodes,
        "running": [readmodel.job_doc(state, state.jobs[j]) for j in list(state.running)],
        "queue": queue[:QUEUE_SHOWN],
        "queue_len": len(queue),
        "finished": [readmodel.job_doc(state, j) for j in finished[:FINISHED_SHOWN]],
        "shares": shares,
        "tail": tail,
    }


class Series:
    """Team holdings over log time, one point per change (coalesced within `every_s`)."""

    def __init__(self, every_s: float = 0.5, keep: int = SERIES["shares"][1]):
        self.every_s = every_s
        self.points: deque[dict[str, Any]] = deque(maxlen=keep)

    def observe(self, state: ClusterState) -> None:
        teams = {t: u.held for t, u in state.teams.items()}
        if not teams:
            return
        if self.points and self.points[-1]["teams"] == teams:
            return
        if self.points and state.now - self.points[-1]["at"] < self.every_s:
            self.points[-1] = {"at": self.points[-1]["at"], "teams": teams}
            return
        self.points.append({"at": state.now, "teams": teams})


class Dashboard:
    def __init__(self, event_log: EventLog, config: PolicyConfig = DEFAULT):
        self.log = event_log
        self.config = config  # the running policy: a pending job is explained under it
        self.folded = FoldedLog(event_log)
        self.folded.listeners.append(self._on_record)
        self.indexes = ExplainIndexes(self.folded)
        self.tail: deque[dict[str, Any]] = deque(maxlen=TAIL)
        self.series = Series()
        self.version = 0
        self.moved = asyncio.Event()
        self.versions = Versions(epoch=uuid.uuid4().hex[:8])
        self.lease: dict[str, Any] = {}
        self.started_at = time.time()

    def _on_record(self, rec: Record, state: ClusterState) -> None:
        self.tail.append(readmodel.event_line(rec.seq, rec.event))
        self.series.observe(state)
        self.version += 1
        self.moved.set()

    # --- the page's model ------------------------------------------------------------------

    def model(self) -> dict[str, Any]:
        return page_model(self.folded.state, self.version, self.lease, list(self.series.points), list(self.tail))

    def publish(self) -> Versions:
        """The model's versions, brought up to the fold's (built at most once per version, for
        however many pages are open)."""
        if self.versions.version != self.version:
            self.versions.publish(self.model())
        return self.versions

    # --- lease (liveness of placement, from the lease bucket it may read) ----------------------

    async def watch_lease(self, stop: asyncio.Event) -> None:
        """Who holds the placement lease, once a second. `reachable`: the bucket answered (a
        credential without read access to it shows no lease at all)."""
        from gpusched.services.lease import PLACEMENT_LEASE_KEY, Watch, open_bucket

        try:
            watch = Watch(await open_bucket(self.log.nc), PLACEMENT_LEASE_KEY, 3000)
        except Exception as err:  # no bucket, or no permission: the page says nothing of a lease
            log.warning("lease_unreadable", error=str(err) or type(err).__name__)
            return
        while not stop.is_set():
            holder = await watch.holder()
            lease = {"placement": holder, "reachable": holder != ""}
            if lease != self.lease:
                self.lease = lease
                self.version += 1
                self.moved.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


# --- HTTP --------------------------------------------------------------------------------------


def _web_file(name: str) -> bytes:
    return importlib.resources.files("gpusched").joinpath("web", name).read_bytes()


CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


async def index(request: web.Request) -> web.Response:
    return web.Response(body=_web_file("index.html"), content_type="text/html", charset="utf-8")


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if "/" in name or name.startswith("."):
        raise web.HTTPNotFound()
    try:
        body = _web_file(name)
    except (FileNotFoundError, IsADirectoryError):
        raise web.HTTPNotFound() from None
    ext = name[name.rfind("."):]
    return web.Response(body=body, content_type=CONTENT_TYPES.get(ext, "application/octet-stream"),
                        headers={"Cache-Control": "no-cache"})


async def api_state(request: web.Request) -> web.Response:
    """The whole model with its version (gzip when the client takes it: 2.5 MB -> ~0.2 MB at
    1,000 nodes)."""
    versions = request.app[DASH].publish()
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        return web.Response(body=versions.gzipped(), content_type="application/json",
                            headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return web.Response(body=versions.full, content_type="application/json")


async def _send_since(resp: web.StreamResponse, versions: Versions, held: int | None) -> None:
    chain = versions.since(held)
    if chain is None:
        await resp.write(f"id: {versions.event_id(versions.version)}\nevent: full\ndata: ".encode() + versions.full + b"\n\n")
        return
    for version, data in chain:
        await resp.write(f"id: {versions.event_id(version)}\nevent: delta\ndata: ".encode() + data + b"\n\n")


async def api_events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the whole model once (`full`, unless `?since=EPOCH-VERSION` or
    `Last-Event-ID` names a version still held), then `delta` events, each keyed by the version
    it applies to (`base`) and the one it makes (`version`; the event id is `EPOCH-VERSION`)."""
    dash: Dashboard = request.app[DASH]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    # the version the page holds: the last event id on a reconnect, else `?since=EPOCH-VERSION`
    held = dash.versions.held(request.headers.get("Last-Event-ID") or request.query.get("since"))
    stop: asyncio.Event = request.app[STOP]
    try:
        while not stop.is_set():
            versions = dash.publish()
            if held != versions.version:
                await _send_since(resp, versions, held)
                held = versions.version
                await asyncio.sleep(PUSH_MIN_INTERVAL_S)
                continue
            dash.moved.clear()
            if dash.version != versions.version:
                continue
            try:
                await asyncio.wait_for(dash.moved.wait(), 15.0)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


async def api_job(request: web.Request) -> web.Response:
    from gpusched.policy.explain import explain_pending

    dash: Dashboard = request.app[DASH]
    job_id = request.match_info["job_id"]
    state = dash.folded.state
    job = state.jobs.get(job_id)
    if job is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"no job {job_id}"}), content_type="application/json")
    out: dict[str, Any] = {"job": _accounted(readmodel.job_doc(state, job), state.now)}
    if job.state == "pending":
        out["why_pending"] = explain_pending(state, job_id, config=dash.config, indexes=dash.indexes())
    return web.json_response(out)


def _client(request: web.Request):
    from gpusched.bus.control_client import Client

    dash: Dashboard = request.app[DASH]
    return Client(dash.log.nc, timeout=5.0)


def _spec(body: dict[str, Any], **defaults: Any) -> JobSpec:
    fields = {**defaults, **{k: v for k, v in body.items() if v not in (None, "")}}
    topo = fields.pop("required", None)
    if topo:
        fields["topology"] = TopologyConstraint(required=topo)
    for key in ("gpus", "min_gpus"):
        if key in fields:
            fields[key] = int(fields[key])
    if "time_limit_s" in fields:
        fields["time_limit_s"] = float(fields["time_limit_s"])
    if "preemptible" in fields:
        fields["preemptible"] = fields["preemptible"] in (True, "true", "on", "1", 1)
    return msgspec.convert(fields, JobSpec)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, ValueError):
        raise web.HTTPBadRequest(text=json.dumps({"ok": False, "error": "body must be JSON"}),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"ok": False, "error": "body must be a JSON object"}),
                                 content_type="application/json")
    return body


async def api_submit(request: web.Request) -> web.Response:
    from gpusched.bus.control_client import ControlPlaneUnavailable

    body = await _body(request)
    try:
        spec = _spec(body, team="web", gpus=1, time_limit_s=3600.0)  # a placeholder must end (admission)
    except (msgspec.ValidationError, ValueError, TypeError) as err:
        return web.json_response({"ok": False, "error": f"invalid job: {err}"}, status=400)
    with telemetry.span("dashboard.submit", team=spec.team, gpus=spec.gpus):
        try:
            reply = await _client(request).submit(spec)
        except ControlPlaneUnavailable as err:
            return web.json_response({"ok": False, "error": str(err)}, status=503)
    return web.json_response(msgspec.to_builtins(reply), status=200 if reply.ok else 409)


async def api_flood(request: web.Request) -> web.Response:
    """A burst of interactive jobs from one team (the chaos scene's flood)."""
    from gpusched.bus.control_client import ControlPlaneUnavailable

    body = await _body(request)
    count = max(1, min(int(body.pop("count", 20)), 500))
    try:
        spec = _spec(body, team="interactive", gpus=1, priority="interactive", time_limit_s=60.0)
    except (msgspec.ValidationError, ValueError, TypeError) as err:
        return web.json_response({"ok": False, "error": f"invalid job: {err}"}, status=400)
    client = _client(request)
    tag = uuid.uuid4().hex[:6]
    with telemetry.span("dashboard.flood", team=spec.team, count=count):
        try:
            replies = await asyncio.gather(*[
                client.submit(msgspec.structs.replace(spec, name=spec.name or f"flood-{tag}-{i}")) for i in range(count)])
        except ControlPlaneUnavailable as err:
            return web.json_response({"ok": False, "error": str(err)}, status=503)
    ok = [r.job_id for r in replies if r.ok]
    return web.json_response({"ok": bool(ok), "submitted": len(ok), "jobs": ok,
                              "errors": sorted({r.error for r in replies if not r.ok})})


async def api_placement(request: web.Request) -> web.Response:
    body = await _body(request)
    action = body.get("action")
    if action not in ("stop", "start", "status"):
        return web.json_response({"ok": False, "error": "action must be stop, start or status"}, status=400)
    dash: Dashboard = request.app[DASH]
    with telemetry.span("dashboard.placement", action=action):
        reply = await control.request(dash.log.nc, "placement", action)
    return web.json_response(reply, status=200 if reply.get("ok") else 503)


async def prometheus(request: web.Request) -> web.Response:
    """This process's metrics: the dashboard's own (the cluster's come from the projector, see
    `gpusched.metrics`), and the cluster's too when this process exports them."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    dash: Dashboard = request.app[DASH]
    if metrics.exporting_cluster():
        metrics.observe_state(dash.folded.state)
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health(request: web.Request) -> web.Response:
    dash: Dashboard = request.app[DASH]
    return web.json_response({"ok": True, "seq": dash.folded.state.last_seq})


DASH: web.AppKey[Dashboard] = web.AppKey("dash", Dashboard)
STOP: web.AppKey[asyncio.Event] = web.AppKey("stop", asyncio.Event)


#: Sent with every response, refusals and event streams included: no page of any origin may
#: frame the dashboard (a transparent frame over its controls turned one click elsewhere into
#: "stop placement", the cookie being same-site for any port of the host).
NO_FRAMING = {"Content-Security-Policy": "frame-ancestors 'none'", "X-Frame-Options": "DENY"}


async def _no_framing(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(NO_FRAMING)


def make_app(dash: Dashboard, stop: asyncio.Event, guard: Guard) -> web.Application:
    app = web.Application(middlewares=[guard_middleware])
    app.on_response_prepare.append(_no_framing)
    app[DASH] = dash
    app[STOP] = stop
    app[GUARD] = guard
    app.router.add_get("/", index)
    app.router.add_get("/api/session", api_session)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/state", api_state)
    app.router.add_get("/api/events", api_events)
    app.router.add_get("/api/job/{job_id}", api_job)
    app.router.add_post("/api/submit", api_submit)
    app.router.add_post("/api/flood", api_flood)
    app.router.add_post("/api/placement", api_placement)
    app.router.add_get("/healthz", health)
    app.router.add_get("/metrics", prometheus)
    return app


async def run(nats_url: str | None, redis_url: str | None, host: str = "127.0.0.1", port: int = 8080,
              stop: asyncio.Event | None = None, ready: asyncio.Event | None = None,
              guard: Guard | None = None, config: PolicyConfig = DEFAULT) -> None:
    """Serve the dashboard until `stop` is set (the entry point `gpusched up` uses). `guard`:
    the login token and allowed hosts (default: `GPUSCHED_DASHBOARD_TOKEN` or a new token);
    `config`: the running policy, which explains a pending job."""
    guard = guard or Guard.from_env(port, [] if host in ("127.0.0.1", "0.0.0.0", "::") else [host])
    telemetry.set_service("dashboard")
    stop = stop or asyncio.Event()
    event_log = await EventLog.open(nats_url, name="gpusched-dashboard")
    dash = Dashboard(event_log, config)  # `redis_url`: kept for its callers; the dashboard reads no Redis
    metrics.attach(dash.folded)
    await dash.folded.start()
    app = make_app(dash, stop, guard)
    runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)  # a login URL carries ?token=
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    lease_task = asyncio.create_task(dash.watch_lease(stop))
    # never the token: this line lands in DATA/logs/dashboard.log (`gpusched up` prints the login URL)
    log.info("dashboard_ready", url=f"http://127.0.0.1:{port}/", bound=host, seq=dash.folded.state.last_seq)
    notify_ready()
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        dash.moved.set()
        lease_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await lease_task
        await runner.cleanup()
        await dash.folded.stop()
        await event_log.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1 only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                        help="another Host the dashboard is reached as (behind a proxy); repeatable")
    policy_arguments(parser)  # a pending job is explained under the running policy


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    guard = Guard.from_env(args.port, [*getattr(args, "allow_host", []),
                                       *([] if args.host in ("127.0.0.1", "0.0.0.0", "::") else [args.host])])
    await run(getattr(args, "nats", None), getattr(args, "redis", None), args.host, args.port, stop, guard=guard,
              config=policy_of(args))
