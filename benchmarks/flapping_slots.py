"""In-flight slots after a flapping Redis: how long until N at once are admitted again?

    python benchmarks/flapping_slots.py [--tree /path/old] [--flap 20] [--out FILE]

A private redis-server that keeps its data across a restart (``SHUTDOWN SAVE``, as a default
redis-server does) serves one ASGI app in process (httpx's ASGI transport): ``/hold``
limited to 3 in flight per client (60 s leases) beside ``1000/minute``, with
``on_backend_error="memory"``. 12 client tasks of one client send ``/hold`` (each holds its
slot 20-100 ms) while Redis is stopped and started every 0.5-1 s for ``--flap`` seconds.
Then Redis stays up, and every 0.25 s 3 requests are sent at once: reported is the time
from Redis's last start until all 3 were admitted (a slot that leaked waits for its lease).
``--tree`` runs another checkout of the package (e.g. efbcb84) the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
N, CLIENTS, GIVE_UP = 3, 12, 75.0


def _redis(port: int, directory: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", directory, "--dbfilename", "flap.rdb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        time.sleep(0.01)
    raise RuntimeError("redis-server did not start")


def _stop(proc: subprocess.Popen[bytes], port: int) -> None:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 2) as s:
        s.sendall(b"SHUTDOWN SAVE\r\n")
        s.recv(64)
    proc.wait(timeout=10)


async def run(flap: float) -> dict[str, float | int]:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    import ratelimit_mw as rl
    from ratelimit_mw import asgi, keys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    directory = tempfile.mkdtemp(prefix="flap")
    server = _redis(port, directory)
    backend = rl.AsyncRedisBackend.from_url(f"redis://127.0.0.1:{port}/0")
    limiter = rl.AsyncLimiter(backend, prefix="flap" + os.urandom(4).hex())

    async def hold(request: object) -> PlainTextResponse:
        await asyncio.sleep(float(request.query_params.get("s", "0.05")))  # type: ignore[attr-defined]
        return PlainTextResponse("ok")

    app = asgi.RateLimitMiddleware(
        Starlette(routes=[Route("/hold", hold)]), limiter, key=keys.header("x-client"),
        default=rl.Policy("1000/minute", algorithm="fixed-window"),
        rules=[asgi.Rule("/hold", concurrency=N)], on_backend_error="memory")
    counts = {"admitted": 0, "refused": 0}
    flapping = True
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=30) as client:
            async def load() -> None:
                while flapping:
                    pause = random.uniform(0.02, 0.1)
                    got = await client.get(f"/hold?s={pause}", headers={"x-client": "c"})
                    counts["admitted" if got.status_code == 200 else "refused"] += 1
                    await asyncio.sleep(0.01)

            tasks = [asyncio.create_task(load()) for _ in range(CLIENTS)]
            loop = asyncio.get_running_loop()
            ends = loop.time() + flap
            restarts = 0
            while loop.time() < ends:
                await asyncio.sleep(random.uniform(0.5, 1.0))
                await asyncio.to_thread(_stop, server, port)
                await asyncio.sleep(random.uniform(0.5, 1.0))
                server = await asyncio.to_thread(_redis, port, directory)
                restarts += 1
            up = loop.time()
            flapping = False
            await asyncio.gather(*tasks)
            while True:
                answers = await asyncio.gather(*(
                    client.get("/hold?s=0.05", headers={"x-client": "c"}) for _ in range(N)))
                if all(answer.status_code == 200 for answer in answers):
                    break
                if loop.time() - up > GIVE_UP:
                    break
                await asyncio.sleep(0.25)
            return {"restarts": restarts, "load_admitted": counts["admitted"],
                    "load_refused": counts["refused"],
                    "seconds_until_3_at_once": round(loop.time() - up, 2)}
    finally:
        await backend.aclose()
        _stop(server, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", help="run this checkout's ratelimit_mw instead")
    parser.add_argument("--flap", type=float, default=20.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.tree:
        env = {**os.environ, "PYTHONPATH": args.tree}
        sys.exit(subprocess.call([sys.executable, __file__, "--flap", str(args.flap),
                                  *(["--out", args.out] if args.out else [])], env=env))
    result = asyncio.run(run(args.flap))
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
