"""The HTTP layer shared by every adapter: which limits apply to a request (`selection`,
built and cached by `guard`), its client address, routing metadata, the headers and bodies
of the answers, and what the ASGI adapters send (`asgi_send`). No I/O here but the ASGI
send: the adapters (`ratelimit_mw.asgi`, `.litestar`, `.wsgi`, `.flask`, `.fastapi`,
`.django`) read the request and write the response."""
