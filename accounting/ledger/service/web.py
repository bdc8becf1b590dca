"""The ledger server's HTTP side: a read-only web page (`--http-port`) and Prometheus metrics (`--metrics-port`).

Both answer only a token the gRPC service accepts: the admin token, or a
tenant's, which sees only its own datasets. The page takes it as
`Authorization: Bearer <token>` or from its sign-in form, which keeps it in
an HttpOnly, SameSite=Strict cookie; without one it answers 401 with that
form. /metrics takes the header only, as Prometheus sends it
(`authorization: {credentials_file: ...}` in a scrape config); the RPC
latencies are the server's, so only the admin token sees them.

aiohttp serves both from one event loop on a thread of its own, beside the
gRPC server in the same process; the ledger's blocking reads run on worker
threads. The chart is plotly.js, served from the plotly package itself, so
the page needs nothing from outside the machine.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import ssl
import threading
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from accounting.ledger.callers import Caller
from accounting.ledger.errors import LedgerError, RateLimited, Unauthenticated
from accounting.ledger.service.metrics import exposition
from accounting.ledger.store import Ledger
from accounting.ledger.service.view import ledger_view

TOKEN_COOKIE = "dpfleet_token"
# The page's own files, in this package's page/ folder.
_PAGE_FILES = {"/page.js": ("page.js", "text/javascript"), "/page.css": ("page.css", "text/css")}
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # plotly.js sets styles inline; nothing else runs but this server's own scripts.
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
}
_NO_TOKEN = (
    "no token: send 'Authorization: Bearer <token>' (the admin token or a tenant's, as for dpfleet ledger --token), "
    "or sign in on this page"
)

Authenticate = Callable[[str], Caller]


@cache
def _page_file(name: str) -> str:
    return resources.files("accounting.ledger.service").joinpath("page", name).read_text(encoding="utf-8")


@cache
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs  # the 4.8 MB bundle, read on the first page load only

    return get_plotlyjs()


def bearer_or_cookie(request: web.Request, cookie_allowed: bool) -> str | None:
    """The request's token: its `Authorization: Bearer` header, else (when allowed) the page's cookie."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.cookies.get(TOKEN_COOKIE) if cookie_allowed else None


async def _caller(authenticate: Authenticate, token: str | None) -> Caller:
    """Who holds `token`; Unauthenticated when there is none or the ledger does not know it."""
    if token is None:
        raise Unauthenticated(_NO_TOKEN)
    return await asyncio.to_thread(authenticate, token)  # a token still stored by scrypt is hashed once


def sign_in_page(message: str) -> str:
    """The page a visitor without a valid token sees: why, and a form for the token."""
    return _page_file("sign_in.html").replace("{{MESSAGE}}", html.escape(message))


def view_page(view: dict) -> str:
    """The page over one `ledger_view`, embedded as JSON that page.js draws."""
    # "<" escaped so that no value can close the script element it sits in.
    embedded = json.dumps(view).replace("<", "\\u003c")
    return _page_file("page.html").replace("{{VIEW_JSON}}", embedded)


def _see_the_page() -> web.Response:
    """303 See Other to the page, after signing in or out."""
    return web.Response(status=303, headers={**_HEADERS, "Location": "/"})


@web.middleware
async def _ledger_refusals(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Too many failed sign-ins with one key id is a 429 with Retry-After, as on the gRPC service; a ledger that
    cannot answer (its database gone, say) a 503 with the ledger's reason, not a traceback."""
    try:
        return await handler(request)
    except RateLimited as error:
        retry = str(max(1, math.ceil(error.retry_after_seconds)))
        return web.Response(status=429, text=f"{error}\n", headers={**_HEADERS, "Retry-After": retry})
    except LedgerError as error:
        return web.Response(status=503, text=f"{error}\n", headers=_HEADERS)


def page_app(ledger: Ledger, authenticate: Authenticate, secure_cookie: bool) -> web.Application:
    """The read-only web page: / (the page), /view.json (its data), /sign-in, /sign-out and its scripts."""

    def refused(message: str) -> web.Response:
        return web.Response(
            status=401, text=sign_in_page(message), content_type="text/html",
            headers={**_HEADERS, "WWW-Authenticate": 'Bearer realm="dpfleet ledger"'},
        )

    async def view_of(request: web.Request) -> dict:
        caller = await _caller(authenticate, bearer_or_cookie(request, cookie_allowed=True))
        return await asyncio.to_thread(ledger_view, ledger, caller)

    async def page(request: web.Request) -> web.Response:
        try:
            view = await view_of(request)
        except Unauthenticated as error:
            return refused(str(error))
        return web.Response(text=view_page(view), content_type="text/html", headers=_HEADERS)

    async def view_json(request: web.Request) -> web.Response:
        try:
            view = await view_of(request)
        except Unauthenticated as error:
            return web.json_response({"error": str(error)}, status=401, headers=_HEADERS)
        return web.json_response(view, headers=_HEADERS)

    async def sign_in(request: web.Request) -> web.Response:
        token = str((await request.post()).get("token", "")).strip()
        try:
            await _caller(authenticate, token or None)
        except Unauthenticated as error:
            return refused(str(error))
        response = _see_the_page()
        response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="Strict", secure=secure_cookie, path="/")
        return response

    async def sign_out(request: web.Request) -> web.Response:
        response = _see_the_page()
        response.del_cookie(TOKEN_COOKIE, path="/")
        return response

    async def page_file(request: web.Request) -> web.Response:
        name, content_type = _PAGE_FILES[request.path]
        return web.Response(text=_page_file(name), content_type=content_type)

    async def plotly_js(request: web.Request) -> web.Response:
        text = await asyncio.to_thread(_plotly_js)
        return web.Response(text=text, content_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    app = web.Application(middlewares=[_ledger_refusals])
    app.router.add_get("/", page)
    app.router.add_get("/view.json", view_json)
    app.router.add_post("/sign-in", sign_in)
    app.router.add_post("/sign-out", sign_out)
    app.router.add_get("/plotly.min.js", plotly_js)
    for path in _PAGE_FILES:
        app.router.add_get(path, page_file)
    return app


def metrics_app(ledger: Ledger, authenticate: Authenticate, server_registry: CollectorRegistry) -> web.Application:
    """/metrics in the Prometheus text format: the caller's datasets, and the RPC latencies for the admin."""

    async def metrics(request: web.Request) -> web.Response:
        try:
            caller = await _caller(authenticate, bearer_or_cookie(request, cookie_allowed=False))
        except Unauthenticated as error:
            return web.Response(
                status=401, text=f"{error}\n", headers={"WWW-Authenticate": 'Bearer realm="dpfleet ledger"'}
            )
        # A scrape never waits for a PLD figure: the gauges are the filter's figures, which need none.
        statuses = await asyncio.to_thread(ledger.list_datasets, True, caller=caller)
        body = exposition(statuses, server_registry if caller.admin else None)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[_ledger_refusals])
    app.router.add_get("/metrics", metrics)
    return app


@dataclass
class WebServer:
    """The running HTTP side; `http_port` and `metrics_port` are the ports bound (None: not served)."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    runners: list[web.AppRunner]
    http_port: int | None
    metrics_port: int | None

    def stop(self) -> None:
        """Close both listeners and end the event loop's thread."""

        async def cleanup() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def start_web(
    ledger: Ledger,
    authenticate: Authenticate,
    server_registry: CollectorRegistry,
    host: str,
    http_port: int | None,
    metrics_port: int | None,
    ssl_context: ssl.SSLContext | None = None,
) -> WebServer:
    """Serve the page on `http_port` and the metrics on `metrics_port` (each None: not served; 0: a free port).

    With `ssl_context` both are HTTPS and the page's cookie is Secure.
    Raises OSError naming the port when one cannot be bound.
    """
    sites = []
    if http_port is not None:
        sites.append(("--http-port", page_app(ledger, authenticate, secure_cookie=ssl_context is not None), http_port))
    if metrics_port is not None:
        sites.append(("--metrics-port", metrics_app(ledger, authenticate, server_registry), metrics_port))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="ledger-http", daemon=True)
    thread.start()
    running = WebServer(loop, thread, [], None, None)

    async def start_sites() -> dict[str, int]:
        bound = {}
        for flag, app, port in sites:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            running.runners.append(runner)
            try:
                await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
            except OSError as error:
                raise OSError(
                    f"cannot listen on {host}:{port} ({error.strerror}); choose another {flag} (0 picks a free one)"
                ) from None
            bound[flag] = runner.addresses[0][1]
        return bound

    try:
        bound = asyncio.run_coroutine_threadsafe(start_sites(), loop).result()
    except BaseException:
        running.stop()
        raise
    running.http_port = bound.get("--http-port")
    running.metrics_port = bound.get("--metrics-port")
    return running
