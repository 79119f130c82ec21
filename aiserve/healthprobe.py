"""``python -m aiserve.healthprobe HOST:PORT [--timeout S] [--service NAME]``: a health check.

Exits 0 iff ``grpc.health.v1.Health/Check`` answers SERVING within the timeout; otherwise
prints one line saying why and exits 1. Compose health checks run it inside each container.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, timeout_s: float, service: str = "") -> str | None:
    """None when ``address`` reports SERVING for ``service``, else the reason it does not."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            details = " ".join(str(exc.details()).split())  # one line, whatever the server said
            return f"{address}: {exc.code().name}: {details}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiserve.healthprobe", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of an aiserve service")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--service", default="", help="service name to check ('' = the server)")
    args = parser.parse_args(argv)
    reason = probe(args.address, args.timeout, args.service)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
