"""gRPC health of the engine (the standard ``grpc.health.v1.Health`` service): SERVING while the engine runs and its
heartbeat is fresh, also through a long prefill (KF-18), NOT_SERVING once it died or wedged — the rule of the HTTP
``/health``; refreshed on every Check and every ``HEALTH_POLL_S`` for Watch subscribers.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health, health_pb2

HEARTBEAT_TIMEOUT_S = 5.0  # as the HTTP front end's /health
HEALTH_POLL_S = 0.5


class EngineHealth(health.aio.HealthServicer):
    """SERVING while the engine runs with a fresh heartbeat, NOT_SERVING otherwise, for ``""`` and
    ``service_name`` (the Engine service)."""

    def __init__(self, engine, service_name: str):
        super().__init__()
        self.engine, self.service_name = engine, service_name

    def alive(self) -> bool:
        if not self.engine.is_running:
            return False
        beat = getattr(self.engine, "last_heartbeat_s", None)
        return beat is None or time.monotonic() - beat < HEARTBEAT_TIMEOUT_S

    async def sync(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self.alive()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", self.service_name):
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request, context):
        await self.sync()
        return await super().Check(request, context)


async def watch_engine(server: grpc.aio.Server, health_servicer: EngineHealth) -> None:
    """Refresh the health status until the server stops (Watch subscribers see the engine die)."""
    while True:
        await health_servicer.sync()
        # True: the wait timed out and the server still runs; False: it stopped (grpc.aio semantics).
        if not await server.wait_for_termination(timeout=HEALTH_POLL_S):
            return
