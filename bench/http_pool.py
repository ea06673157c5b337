"""What idle connections kept in httpx's pool cost a request: `python -m bench.http_pool`.

The worker's shared HTTP client (`worker.http_limits`) sends every followed job's ComfyUI calls.
httpcore's pool looks at every connection it keeps at each request's start and end, polling
each idle one's socket, so a request costs more the more connections are kept idle. This sends
rounds of concurrent GETs to a loopback server that answers after 50 ms, through one client per
setting, and prints the process's CPU per request against 20 kept (httpx's default) as the
baseline. The worker keeps a fifth of its slots: the scale group did better so (RESULTS.md).
Not part of `make bench`: a comparison of two pool settings, run when they change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httpx

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
ROUNDS = 3
BASELINE_KEPT = 20


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # Cancelled too when the server closes: Python 3.11's stream callback would print the
    # cancelled handler's traceback (it asks the task for its exception).
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        while True:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(0.05)
            writer.write(ANSWER)
            await writer.drain()
    writer.close()


async def cpu_ms_per_request(url: str, concurrent: int, kept: int) -> float:
    limits = httpx.Limits(max_connections=concurrent + 64, max_keepalive_connections=kept)
    timeout = httpx.Timeout(60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        began = time.process_time()
        for _ in range(ROUNDS):
            await asyncio.gather(*(http.get(url) for _ in range(concurrent)))
        return 1000 * (time.process_time() - began) / (ROUNDS * concurrent)


async def main(concurrent: list[int], kept: list[int]) -> None:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0, backlog=4096)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    async with server:
        print("| concurrent requests | idle kept | CPU ms per request | vs 20 kept |")
        print("|---|---|---|---|")
        for n in concurrent:
            baseline = await cpu_ms_per_request(url, n, BASELINE_KEPT)
            for k in kept:
                cost = baseline if k == BASELINE_KEPT else await cpu_ms_per_request(url, n, k)
                print(f"| {n} | {k} | {cost:.2f} | {cost / baseline:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--kept", type=int, nargs="+", default=[20, 200])
    args = parser.parse_args()
    asyncio.run(main(args.concurrent, args.kept))
