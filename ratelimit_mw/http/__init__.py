"""The HTTP layer shared by every adapter: which limits apply to a request, its client
address, routing metadata, and the headers and bodies of the answers. No I/O here: the
adapters (`ratelimit_mw.asgi`, `.wsgi`, `.flask`, `.fastapi`) read the request and write
the response."""
