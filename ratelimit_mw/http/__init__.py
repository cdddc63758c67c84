"""The HTTP layer shared by every adapter, above the limiter (nothing below imports it).

- what a request may be limited by: the options (`config`), path `rules`, the limits an
  endpoint's decorators carry (`asgi_routes`);
- which of them apply to one method and route, worked out once (`selection`), and what to do
  with one request, asking the store once at most (`guard`), in front of the `breaker`, with
  the in-flight `slots` a response's own calls do not settle;
- the answer: the RateLimit fields and the 429 and 503 bodies (`headers`), FastAPI's schema of
  the 429 (`openapi`), and what the ASGI adapters send (`asgi_send`);
- the request a plain WSGI app's key functions read (`environ_request`, `werkzeug_request`);
- what the outbound transports share (`outbound`, and `usage`: what a provider's answer says
  it cost); which extra a missing framework needs (`extras`).

No socket here: the store is reached through the limiter, and the adapters
(`ratelimit_mw.asgi`, `.litestar`, `.wsgi`, `.flask`, `.fastapi`, `.django`) read the request
and write the response, the ASGI ones through `asgi_send`."""
