"""The sans-I/O engine: everything that decides, nothing that does I/O.

Read in this order: `rates` (rate text → Rate), `policy` (tiers, algorithm, penalty,
calendar zone), `identity` (identities → safe key segments), `wire` (a policy's keys and
script arguments, calendar schedules), `plans` (checks → one script call; reply → Decision),
`decision` (the result), `deny_cache` (refusals remembered in process), `scripts` (the Lua
source the Redis backend registers, read at first use), `errors`.
"""
