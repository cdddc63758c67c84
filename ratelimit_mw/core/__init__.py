"""The sans-I/O core: what a limit is and what a store is asked, nothing that does I/O.

Read in this order: `rates` (rate text → Rate), `policy` (tiers, algorithm, penalty,
calendar zone), `identity` (identities → safe key segments), `wire` (a policy's algorithm
code, key segment and script arguments, calendar schedules), `codec` (the ops; checks → one
script call, a reply → Decision), `compiled` (a set of limits compiled once: a hit's memoised
call and wire bytes, and where the limiter keeps its in-process decision of it), `decision` (the
result), `deny_cache` (refusals remembered in process), `scripts` (the Lua source the Redis
backend registers, read at first use), `errors`.

Then the stores that answer these calls (`ratelimit_mw.backends`: `base`, the memory
backend's `_store`, `_log`, `_algorithms`, `_script` and `memory`, then `redis`), and the
HTTP layer that decides which limits apply to a request (`ratelimit_mw.http.selection`).
"""
