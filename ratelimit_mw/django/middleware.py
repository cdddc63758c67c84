"""``ratelimit_mw.django.RateLimitMiddleware``: the guard in Django's middleware chain.

Sync and async capable by Django's rules: under WSGI (gunicorn) it runs sync on a `Limiter`,
under ASGI (uvicorn) async on an `AsyncLimiter`, its ``process_view`` a coroutine there, so
no request hops to a thread. The decision is made in ``process_view``, once Django has
resolved the view (its decorators and URL pattern are known): the default, the path rules
and the view's limits in one call. A request that reaches no view (a 404, or a middleware
that answered first) is decided on its way out, under the default and the rules. The
decision is ``request.ratelimit`` for the view; admitted responses get the RateLimit
headers, refused ones are a JSON 429 (or ``on_blocked(request, decision)``'s response).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase

from ratelimit_mw._async import slots as slots_async
from ratelimit_mw._async.handler import handler_async
from ratelimit_mw._sync import slots as slots_sync
from ratelimit_mw._sync.handler import handler_sync
from ratelimit_mw.core.errors import ConfigurationError
from ratelimit_mw.django import conf
from ratelimit_mw.django.decorators import handles, view_limits
from ratelimit_mw.http.guard import Guard
from ratelimit_mw.http.headers import Headers
from ratelimit_mw.http.selection import Selection
from ratelimit_mw.http.verdict import Admit, Held, Refuse, Verdict
from ratelimit_mw.keys import reads
from ratelimit_mw.wsgi import renewing

# On the request between process_view and the response: the verdict, or _NONE when no limit
# applied. Absent: no view was reached.
_VERDICT = "_ratelimit_mw_verdict"
_NONE = object()
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})
_VIEW_CACHE_SIZE = 4096
# The releases of in-flight slots started from a response's close (ASGI Django), until done.
_RELEASES: set[asyncio.Task[None]] = set()


async def _renewing_async(chunks: AsyncIterator[Any], guard: Guard, limiter: Any,
                          held: Held) -> AsyncIterator[Any]:
    """An async streamed body, renewing the lease of the slots `held` on a chunk that comes a
    third of a lease after the last renewal."""
    async for chunk in chunks:
        if held.due():
            await slots_async.renew_async(guard, limiter, held)
        yield chunk


def _set_missing(response: HttpResponseBase, headers: Headers) -> HttpResponseBase:
    for name, value in headers:
        if name not in response:
            response[name] = value
    return response


def _json(status: int, headers: Headers, body: bytes) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="application/json")
    for name, value in headers:
        if name != "Content-Type":
            response[name] = value
    # Django logs every 4xx and 5xx it serves, once per response: a flood of refusals would
    # log one line per request (the middleware's own log is throttled).
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


class RateLimitMiddleware:
    """Add ``"ratelimit_mw.django.RateLimitMiddleware"`` to ``MIDDLEWARE`` (after the
    authentication middleware when a key reads ``request.user``); configure it in
    ``settings.RATELIMIT`` (`ratelimit_mw.django.conf`)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        try:
            limiters = conf.current()
        except ConfigurationError as exc:
            raise ImproperlyConfigured(str(exc)) from exc
        self.asynchronous = iscoroutinefunction(get_response)
        # The guards are the settings' (conf.Limiters): is_ratelimited shares their breaker.
        if self.asynchronous:
            markcoroutinefunction(self)
            self.limiter: Any = limiters.asynchronous()
            self.guard: Guard = limiters.async_guard()
            # A coroutine function: Django awaits it as is, with no thread in between.
            self.process_view: Any = self._process_view_async
        else:
            self.limiter = limiters.sync()
            try:
                self.guard = limiters.sync_guard()
            except ConfigurationError as exc:
                raise ImproperlyConfigured(str(exc)) from exc
            self.process_view = self._process_view_sync
        # (view, method) -> what it carries; bounded by the URLconf's views and the methods
        # their classes handle.
        self._views: dict[tuple[Any, str], object] = {}
        # id(selection) -> whether a key of it reads the user (selections live as long as
        # the guard's cache keeps them: bounded the same way).
        self._user_keys: dict[int, bool] = {}

    def __repr__(self) -> str:
        return f"RateLimitMiddleware({self.limiter!r})"

    # -- which limits apply ----------------------------------------------------------------
    def _selection(self, request: HttpRequest, view: Any) -> Selection | None:
        method = request.method or "GET"
        # A method a class-based view has a handler for (PURGE) is its own entry; any other
        # method a client invents shares "OTHER": bounded by the code, not by the clients.
        cache_key = (view, method if method in _METHODS or handles(view, method) else "OTHER")
        try:
            route = self._views[cache_key]
        except KeyError:
            route = view_limits(view, method) if view is not None else None
            if len(self._views) >= _VIEW_CACHE_SIZE:
                self._views.clear()
            self._views[cache_key] = route
        return self.guard.select(method, request.path_info, route)

    def _reads_user(self, selection: Selection) -> bool:
        """Whether a key of `selection` (or of its fallback) may read ``request.user``."""
        found = self._user_keys.get(id(selection))
        if found is None:
            found = any("user" in reads(item.key) for item in selection.applied) or (
                selection.fallback is not None and self._reads_user(selection.fallback))
            self._user_keys[id(selection)] = found
        return found

    @staticmethod
    def _preflight(request: HttpRequest) -> bool:
        return (request.method == "OPTIONS"
                and "HTTP_ACCESS_CONTROL_REQUEST_METHOD" in request.META)

    # -- the verdict as a response ---------------------------------------------------------
    def _refused(self, request: HttpRequest, verdict: Refuse, made: Any) -> HttpResponseBase:
        """The 429: `made`, what ``on_blocked`` returned (None: the JSON one)."""
        if made is not None:
            if isinstance(made, HttpResponseBase):
                # A 429 always carries Retry-After and the RateLimit fields.
                return _set_missing(made, verdict.headers)
            self.guard.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429",
                                   TypeError(f"on_blocked returned {made!r}, not a response"))
        return _json(429, verdict.headers, verdict.body)

    def _answer(self, request: HttpRequest, verdict: Verdict | None,
                made: Any = None) -> HttpResponseBase | None:
        """Remember the verdict for the response; the response instead of the view for a
        refusal or an outage."""
        setattr(request, _VERDICT, _NONE if verdict is None else verdict)
        if verdict is None:
            return None
        if isinstance(verdict, Admit):
            request.ratelimit = verdict.decision  # type: ignore[attr-defined]
            return None
        if isinstance(verdict, Refuse):
            request.ratelimit = verdict.decision  # type: ignore[attr-defined]
            return self._refused(request, verdict, made)
        return _json(verdict.status, verdict.headers, verdict.body)

    def _blocked(self, request: HttpRequest, verdict: Verdict | None) -> Any:
        """``on_blocked``'s answer for a refusal (None: none, or it failed)."""
        on_blocked = self.guard.config.on_blocked
        if on_blocked is None or not isinstance(verdict, Refuse):
            return None
        try:
            return on_blocked(request, verdict.decision)
        except Exception as exc:
            self.guard.log_failure("ratelimit_mw on_blocked failed; answering the JSON 429", exc)
            return None

    def _headed(self, request: HttpRequest, response: HttpResponseBase) -> Admit | None:
        """Add an admitted request's headers to its response; the Admit, if any."""
        verdict = getattr(request, _VERDICT, None)
        if not isinstance(verdict, Admit):
            return None
        if verdict.headers:
            _set_missing(response, verdict.headers)
        return verdict

    # -- sync (WSGI) -----------------------------------------------------------------------
    def __call__(self, request: HttpRequest) -> Any:
        if self.asynchronous:
            return self._call_async(request)
        request.ratelimit = None  # type: ignore[attr-defined]
        response = self.get_response(request)
        if not hasattr(request, _VERDICT):  # no view was reached: the default and the rules
            refused = self._process_view_sync(request, None, (), {})
            if refused is not None:
                return refused
        admit = self._headed(request, response)
        if admit is not None and admit.plan is not None:
            if self.guard.holding(admit) is not None:
                self._hold_sync(admit, response)
            else:
                slots_sync.refund_sync(self.guard, self.limiter, admit,
                                       self.guard.given_back(admit, response.status_code))
        return response

    def _hold_sync(self, admit: Admit, response: HttpResponseBase) -> None:
        """Give the slots back (with what the status gives back) when Django closes the
        response, once it has been sent (its server closes it also when the client went
        away); a streamed body renews their lease as it is read."""
        guard, limiter = self.guard, self.limiter
        held = guard.holding(admit)
        if held is None:  # the caller holds slots: `holding` answers for those
            raise ValueError("an admitted Django response without in-flight slots to hold")
        status = response.status_code

        def release() -> None:
            if not held.done:
                held.done = True
                slots_sync.release_sync(guard, limiter, admit, status)

        if response.streaming and not response.is_async:  # type: ignore[attr-defined]
            response.streaming_content = renewing(  # type: ignore[attr-defined]
                response.streaming_content, guard, limiter, held)  # type: ignore[attr-defined]
        # Last: the view's body is closed (its own clean-up done) before the slot goes back.
        response._resource_closers.append(release)  # type: ignore[attr-defined]

    def _process_view_sync(self, request: HttpRequest, view: Any, args: Any,
                           kwargs: Any) -> HttpResponseBase | None:
        selection = self._selection(request, view)
        verdict = None if selection is None else handler_sync(
            self.guard, self.limiter, selection)(request, request.method or "GET",
                                                 self._preflight(request))
        return self._answer(request, verdict, self._blocked(request, verdict))

    # -- async (ASGI) ----------------------------------------------------------------------
    async def _call_async(self, request: HttpRequest) -> Any:
        request.ratelimit = None  # type: ignore[attr-defined]
        response = await self.get_response(request)
        if not hasattr(request, _VERDICT):
            refused = await self._process_view_async(request, None, (), {})
            if refused is not None:
                return refused
        admit = self._headed(request, response)
        if admit is not None and admit.plan is not None:
            if self.guard.holding(admit) is not None:
                self._hold_async(admit, response)
            else:
                await slots_async.refund_async(self.guard, self.limiter, admit,
                                               self.guard.given_back(admit, response.status_code))
        return response

    def _hold_async(self, admit: Admit, response: HttpResponseBase) -> None:
        """`_hold_sync` on the event loop: Django closes the response in a thread once it
        has been sent, and the release is a task on this loop; an async streamed body
        renews the lease as it is read."""
        guard, limiter = self.guard, self.limiter
        held = guard.holding(admit)
        if held is None:  # the caller holds slots: `holding` answers for those
            raise ValueError("an admitted Django response without in-flight slots to hold")
        status = response.status_code
        loop = asyncio.get_running_loop()

        def start() -> None:
            task = loop.create_task(slots_async.release_async(guard, limiter, admit, status))
            _RELEASES.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(_RELEASES.discard)

        def release() -> None:
            if held.done:
                return
            held.done = True
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                start()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(start)

        if response.streaming and response.is_async:  # type: ignore[attr-defined]
            response.streaming_content = _renewing_async(  # type: ignore[attr-defined]
                response.streaming_content, guard, limiter, held)  # type: ignore[attr-defined]
        response._resource_closers.append(release)  # type: ignore[attr-defined]

    async def _process_view_async(self, request: HttpRequest, view: Any, args: Any,
                                  kwargs: Any) -> HttpResponseBase | None:
        selection = self._selection(request, view)
        if selection is not None and hasattr(request, "auser") and self._reads_user(selection):
            # django.contrib.auth's request.user loads lazily, from the database: on the event
            # loop that raises (SynchronousOnlyOperation), and a user key would read no user.
            request.user = await request.auser()
        verdict = None if selection is None else await handler_async(
            self.guard, self.limiter, selection)(request, request.method or "GET",
                                                 self._preflight(request))
        made = self._blocked(request, verdict)
        if inspect.isawaitable(made):
            try:
                made = await made
            except Exception as exc:
                self.guard.log_failure("ratelimit_mw on_blocked failed; answering the JSON "
                                       "429", exc)
                made = None
        return self._answer(request, verdict, made)
