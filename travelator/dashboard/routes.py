"""``/dashboard`` (the page) and ``/dashboard/stream`` (its records, server-sent events).

The stream: first an ``info`` event (model, seats, pool size), then one ``message`` event per
step whose data is a walkway record (``walkway.py``) with its ``seq``; a ``dropped``
event says how many records a slow reader missed; a comment line every 15 s keeps idle
connections open. ``?after=N`` resumes after record N (an EventSource sends
``Last-Event-ID`` on its own); a new stream starts ``backlog`` records back, so the page
fills at once.

With an API key, both need it: ``Authorization: Bearer <key>``, or the cookie the page's login
form sets (the key is asked for once; the cookie holds an HMAC of it, never the key). Without
one, they answer only clients on this machine (loopback; behind a proxy that sends
X-Forwarded-For, uvicorn reports the proxy's client): a server listening on the network
without a key shows its batch, queue and prompts to nobody else (403).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from travelator.dashboard.feed import StepFeed
from travelator.dashboard.page import login_page, render_page
from travelator.server.auth import bearer_matches, is_loopback
from travelator.server.body import read_bounded
from travelator.server.errors import APIError

COOKIE = "travelator_dashboard"
HEARTBEAT_S = 15.0
BATCH_S = 0.05  # a stream sends at most 20 writes a second, each with every step since the last
BACKLOG = 300
LOGIN_BODY_BYTES = 4096  # the login form: one field, the key


class DashboardAuth:
    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        self.cookie = None if api_key is None else hmac.new(
            secrets.token_bytes(32), api_key.encode(), hashlib.sha256).hexdigest()

    def refusal(self, request: Request) -> APIError | None:
        """Why ``request`` may not see the live view: a 403 (no key, not this machine), a 401
        (no or wrong key); None when it may."""
        if self.api_key is None:
            if is_loopback(request.client.host if request.client is not None else None):
                return None
            return APIError(403, "the server has no API key, so the live view is open to this machine "
                                 "only; start it with --api-key to show it to others (the page then "
                                 "asks for the key)", code="dashboard_local_only")
        if bearer_matches(request.headers.get("authorization", ""), self.api_key):
            return None
        if secrets.compare_digest(request.cookies.get(COOKIE, "").encode(), self.cookie.encode()):
            return None
        return APIError(401, "missing or wrong API key: log in at /dashboard, or send "
                             "'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_key(self, key: str) -> bool:
        return self.api_key is not None and secrets.compare_digest(key.encode(), self.api_key.encode())


def dashboard_routes(feed: StepFeed, info: dict, api_key: str | None, unavailable: str | None = None) -> APIRouter:
    """``info``: the recorder's fixed facts. ``unavailable``: why there is no live view (the
    routes then answer 404 with it)."""
    router = APIRouter(prefix="/dashboard", include_in_schema=False)
    auth = DashboardAuth(api_key)

    @router.get("")
    async def page(request: Request) -> Response:
        if unavailable is not None:
            raise APIError(404, unavailable, code="dashboard_unavailable")
        refusal = auth.refusal(request)
        if refusal is not None and refusal.status == 401:
            return HTMLResponse(login_page(), status_code=401)
        if refusal is not None:
            raise refusal
        return HTMLResponse(render_page(), headers={"Cache-Control": "no-store"})

    @router.post("/login")
    async def login(request: Request) -> Response:
        if auth.api_key is None:
            return RedirectResponse("/dashboard", status_code=303)
        body = (await read_bounded(request, LOGIN_BODY_BYTES)).decode("utf-8", "replace")
        key = parse_qs(body).get("key", [""])[0]
        if not auth.check_key(key):
            return HTMLResponse(login_page(error="That key is not the server's."), status_code=401)
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(COOKIE, auth.cookie, httponly=True, samesite="strict", path="/dashboard")
        return response

    def require_access(request: Request) -> None:
        """The data endpoints: 404 without a live view, else as ``DashboardAuth.refusal``."""
        if unavailable is not None:
            raise APIError(404, unavailable, code="dashboard_unavailable")
        if (refusal := auth.refusal(request)) is not None:
            raise refusal

    @router.get("/stream")
    async def stream(request: Request) -> Response:
        require_access(request)
        after = _resume_point(feed, request.query_params.get("after"), request.headers.get("last-event-id"))
        return StreamingResponse(_events(feed, info, after), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @router.get("/info")
    async def get_info(request: Request) -> Response:
        require_access(request)
        return JSONResponse(info)

    return router


def _resume_point(feed: StepFeed, after: str | None, last_event_id: str | None) -> int:
    """The record a stream starts after: ``?after=N``, or an EventSource's Last-Event-ID
    ("<instance>-<seq>", this feed's own only); otherwise the backlog."""
    seq = -1
    if after is not None and after.isascii() and after.isdigit() and len(after) < 19:
        seq = int(after)
    elif last_event_id:
        instance, _, number = last_event_id.partition("-")
        if instance == feed.instance and number.isascii() and number.isdigit() and len(number) < 19:
            seq = int(number)
    if 0 <= seq <= feed.last_seq:
        return seq
    return max(0, feed.last_seq - BACKLOG)


async def _events(feed: StepFeed, info: dict, after: int):
    yield f"event: info\ndata: {json.dumps({**info, 'instance': feed.instance})}\n\n"
    while True:
        closed = feed.closed  # read first: what was published before the close still goes out
        records, dropped = feed.since(after)
        if dropped:
            yield f"event: dropped\ndata: {dropped}\n\n"
        if records:
            after = records[-1][0]
            yield "".join(f"id: {feed.instance}-{seq}\ndata: {data}\n\n" for seq, data in records)
            await asyncio.sleep(BATCH_S)  # let steps gather: one write for many of them
        elif closed:
            return
        elif not await feed.wait_after(after, HEARTBEAT_S):
            yield ": idle\n\n"
