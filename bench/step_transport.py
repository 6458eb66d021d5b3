"""What receiving one engine step's message costs a replica, by transport.

A step channel (deployments/step_channel.py) sends one message per engine step to each
downstream replica (the ingress; in the disaggregated app the PD router, which sends it on),
carrying every request's new tokens. Its messages are the items of a Serve streaming call.
This measures, in a downstream Serve replica, the CPU that receiving one such message takes
(the replica process's CPU, all threads, over the stream, per message) for:

- ``serve``: a stream=True DeploymentHandle call to an upstream Serve deployment (how step
  channels and per-request streams arrive today);
- ``ray``: a plain Ray actor method with ``num_returns="streaming"`` (Ray's streaming
  generator without Serve's layers);
- ``socket``: a TCP stream on 127.0.0.1 between the same two replicas, length-prefixed
  pickles, read on the replica's event loop.

Each message is a list of ``--requests`` (request id, StepOutput) pairs with one token each,
as a step channel carries at that concurrency. Two pacings: back to back, and one message
every ``--gap-ms`` (an engine step's time under load: the consumer sleeps between messages,
as a replica does between steps). ``idle`` is the consumer's CPU over the same wall time with
no stream (Ray's and Serve's own threads); the ``above idle`` column subtracts it. The
transports alternate in every repeat; the script prints the median of the repeats.

    python bench/step_transport.py [--messages 2000] [--paced-messages 200] [--gap-ms 20]
        [--requests 16] [--repeats 3] [--json bench/results/step_transport.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import resource
import statistics
import struct
from pathlib import Path
from typing import Any

from local_cluster import start_local_serve, stop_local_serve
from threads import cpu_model

from deployments.protocol import SeqDelta, StepOutput

TRANSPORTS = ("serve", "ray", "socket")
_FRAME = "!I"  # a frame: its length, then a pickle (a format: Struct objects do not pickle)
_FRAME_SIZE = struct.calcsize(_FRAME)
SENDER_SETTLE_S = 0.1


def step_message(requests: int) -> list[tuple[str, StepOutput]]:
    return [
        (f"cmpl-{i:032x}", StepOutput([SeqDelta(0, [1234])], 40, seq=7)) for i in range(requests)
    ]


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _produce(count: int, gap_s: float, requests: int):
    message = step_message(requests)
    for _ in range(count):
        if gap_s:
            await asyncio.sleep(gap_s)
        yield message


def deployments() -> Any:
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Upstream:
        """The engine replica's side: a Serve streaming method, and a socket server."""

        async def steps(self, count: int, gap_s: float, requests: int):
            async for message in _produce(count, gap_s, requests):
                yield message

        async def open_socket(self, count: int, gap_s: float, requests: int) -> int:
            async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                async for message in _produce(count, gap_s, requests):
                    data = pickle.dumps(message, protocol=5)
                    writer.write(struct.pack(_FRAME, len(data)) + data)
                    await writer.drain()
                writer.close()
                server.close()

            server = await asyncio.start_server(send, "127.0.0.1", 0)
            return int(server.sockets[0].getsockname()[1])

        def cpu_s(self) -> float:
            return process_cpu_s()

    @ray.remote(num_cpus=0.1)
    class RayUpstream:
        async def steps(self, count: int, gap_s: float, requests: int):
            async for message in _produce(count, gap_s, requests):
                yield message

        def cpu_s(self) -> float:
            return process_cpu_s()

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Downstream:
        """The ingress's side: receives a stream and returns its CPU per message."""

        def __init__(self, upstream: Any) -> None:
            self.upstream = upstream
            self.stream = upstream.options(stream=True)
            self.ray_upstream = RayUpstream.remote()

        async def receive(self, transport: str, count: int, gap_s: float, requests: int):
            """This process's CPU and the sender's over one stream of ``count`` messages."""
            sender = self.ray_upstream if transport == "ray" else self.upstream
            reader = writer = None
            if transport == "socket":
                port = await self.upstream.open_socket.remote(count, gap_s, requests)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            sent0 = await sender.cpu_s.remote()
            cpu0, received = process_cpu_s(), 0
            if transport == "serve":
                async for message in self.stream.steps.remote(count, gap_s, requests):
                    received += len(message) > 0
            elif transport == "ray":
                call = self.ray_upstream.steps.options(num_returns="streaming")
                async for ref in call.remote(count, gap_s, requests):
                    received += len(await ref) > 0
            elif transport == "socket":
                assert reader is not None and writer is not None
                while True:
                    try:
                        head = await reader.readexactly(_FRAME_SIZE)
                    except asyncio.IncompleteReadError:
                        break
                    message = pickle.loads(await reader.readexactly(struct.unpack(_FRAME, head)[0]))
                    received += len(message) > 0
                writer.close()
            else:  # idle: the same wall time with nothing sent or received
                await asyncio.sleep(count * gap_s)
                received = count
            cpu_s = process_cpu_s() - cpu0
            assert received == count, (transport, received, count)
            # What the sender does after its last message (a generator's end, sends Serve
            # queued) is its cost too; the settling time's idle CPU is under 1 us a message.
            await asyncio.sleep(SENDER_SETTLE_S)
            return cpu_s, await sender.cpu_s.remote() - sent0

    return Downstream.bind(Upstream.bind())


def cpu_description() -> str:
    """lscpu's model name, with /proc/cpuinfo's family and model where there is one."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return cpu_model()
    if "cpu family" not in fields:
        return cpu_model()
    return f"{cpu_model()} family {fields['cpu family']} model {fields.get('model', '?')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="back to back")
    parser.add_argument("--paced-messages", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=16, help="(request, step) pairs a message")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench/results/step_transport.json")
    args = parser.parse_args()

    from ray import serve

    load = [os.getloadavg()[0]]
    start_local_serve(num_cpus=2)
    # pacing -> side ("receive": the downstream replica, "send": the upstream) -> transport ->
    # CPU ms per message, one per repeat.
    cpu_ms: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        handle = serve.run(deployments(), name="step-transport", route_prefix=None)
        pacings = {
            "back to back": (args.messages, 0.0),
            f"one every {args.gap_ms:g} ms": (args.paced_messages, args.gap_ms / 1e3),
        }
        handle.receive.remote("serve", 20, 0.0, args.requests).result()  # warm-up
        for pacing, (count, gap_s) in pacings.items():
            sides: dict[str, dict[str, list[float]]] = {"receive": {}, "send": {}}
            cpu_ms[pacing] = sides
            kinds = [*TRANSPORTS, "idle"] if gap_s else list(TRANSPORTS)
            for repeat in range(args.repeats):
                for kind in kinds[:: -1 if repeat % 2 else 1]:
                    got, sent = handle.receive.remote(kind, count, gap_s, args.requests).result()
                    sides["receive"].setdefault(kind, []).append(1e3 * got / count)
                    sides["send"].setdefault(kind, []).append(1e3 * sent / count)
            load.append(os.getloadavg()[0])
    finally:
        stop_local_serve()

    cpu = cpu_description()
    print(f"{cpu}; load average {min(load):.2f}-{max(load):.2f}")
    print(f"a message: {args.requests} (request id, StepOutput) pairs of one token each")
    result: dict[str, Any] = {"cpu": cpu, "load": load, "args": vars(args)}
    for pacing, sides in cpu_ms.items():
        print(f"\n{pacing}: CPU per message (ms), median of {args.repeats}")
        print(
            f"{'transport':<10}{'receiver':>10}{'above idle':>12}{'/ socket':>10}"
            f"{'sender':>10}{'above idle':>12}{'/ socket':>10}"
        )
        medians = {
            side: {kind: statistics.median(v) for kind, v in per_kind.items()}
            for side, per_kind in sides.items()
        }
        idle = {side: median.pop("idle", 0.0) for side, median in medians.items()}
        for kind in TRANSPORTS:
            cells = []
            for side in ("receive", "send"):
                above = medians[side][kind] - idle[side]
                socket = max(medians[side]["socket"] - idle[side], 1e-6)
                cells.append(f"{medians[side][kind]:>10.3f}{above:>12.3f}{above / socket:>10.1f}")
            print(f"{kind:<10}" + "".join(cells))
        if any(idle.values()):
            print(f"{'idle':<10}{idle['receive']:>10.3f}{'':>22}{idle['send']:>10.3f}")
        result[pacing] = {"median_ms": medians, "idle_ms": idle, "runs_ms": sides}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
