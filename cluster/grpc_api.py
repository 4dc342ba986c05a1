"""The gRPC adapter: the Serve ingress deployment whose methods are the RPCs of `specd.v1.SpecDecode`
(and `Check` of the standard grpc.health.v1 service; Serve's gRPC proxy routes to them by the
`application` metadata key), over the transport-neutral `cluster.router.Router`, and the host of
the HTTP adapter (`cluster.http`, built once the replica exists).

Each RPC reads its call's bearer token and deadline, turns the proto into the router's request
(`cluster.wire`), and maps a `RouterError`'s status onto the call's code and details.
"""
from __future__ import annotations

import time

import grpc

from actors.hardware import hardware_line
from actors.schema import Delta
from protos import specd_pb2

from .config import draft_deployment_name
from .router import HEALTH_SERVICES, Router, RouterError, Status
from .wire import delta_to_proto, request_from_proto, stats_to_proto


def _authorization(grpc_context) -> str | None:
    return dict(grpc_context.invocation_metadata()).get("authorization") if grpc_context is not None else None


def _fail(grpc_context, err: RouterError) -> None:
    grpc_context.set_code(grpc.StatusCode[err.status.name])
    grpc_context.set_details(err.message)


class RouterDeployment(Router):
    """The router as Serve deploys it: gRPC methods here, the OpenAI-compatible HTTP app beside them."""

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP API over this router (Serve calls it once the replica is built)."""
        from .http import build_http_app

        return build_http_app(self)

    async def _stream(self, pb: specd_pb2.GenerateRequest, grpc_context):
        """Authorize, validate and stream one call: (Delta, coalesced) pairs; RouterError on refusal."""
        tenant = self.authorize(_authorization(grpc_context))
        try:
            fields = request_from_proto(pb)
        except ValueError as e:
            self.counters["requests_total"] += 1
            raise RouterError(Status.INVALID_ARGUMENT, str(e)) from None
        req = await self.request(**fields, tenant=tenant)
        remaining = grpc_context.time_remaining() if hasattr(grpc_context, "time_remaining") else None
        async for item in self.generate(req, self.timeout_s(remaining)):
            yield item

    def _refuses(self, grpc_context) -> bool:
        """For the unary control RPCs: True (with UNAUTHENTICATED set on the call) when unauthorized."""
        try:
            self.authorize(_authorization(grpc_context))
            return False
        except RouterError as e:
            if grpc_context is None:
                raise
            _fail(grpc_context, e)
            return True

    async def GenerateStream(self, request: specd_pb2.GenerateRequest, grpc_context):
        rid = request.request_id
        try:
            async for delta, coalesced in self._stream(request, grpc_context):
                yield delta_to_proto(delta, rid or delta.request_id, coalesced)
        except Exception as e:
            _fail(grpc_context, self.failure(e))
            raise  # a stream must raise for Serve to end it with the status set above

    async def Generate(self, request: specd_pb2.GenerateRequest, grpc_context) -> specd_pb2.GenerateResponse:
        deltas, coalesced = [], False
        try:
            async for delta, coalesced in self._stream(request, grpc_context):
                deltas.append(delta)
        except Exception as e:
            _fail(grpc_context, self.failure(e))
            return specd_pb2.GenerateResponse()
        if not deltas:
            return specd_pb2.GenerateResponse()
        joined = Delta.join(deltas)
        return delta_to_proto(joined, request.request_id or joined.request_id, coalesced)

    async def GetStats(self, request, grpc_context=None) -> specd_pb2.StatsResponse:
        """Router counters, and every live verifier and draft replica (each asked through its
        own pinned call, so all of a pool's replicas appear, not the one a handle picked)."""
        if self._refuses(grpc_context):
            return specd_pb2.StatsResponse()
        r = specd_pb2.StatsResponse(requests_active=self.admitted, uptime_seconds=time.time() - self.started,
                                    **self.counters)
        if self.spec_totals.target_passes:
            r.spec_stats.CopyFrom(stats_to_proto(self.spec_totals))
        for v in await self.each(self.verifier, "Verifier", "stats"):
            r.requests_queued += v.get("queued", 0)
            rep = r.replicas.add(replica_id=v["replica_id"], role="verifier", active_sequences=v["active_sequences"],
                                 kv_slots_in_use=v["kv_slots_in_use"], kv_slots_total=v["kv_slots_total"],
                                 dtype=v["engine"].get("dtype", ""), dtype_reason=v["engine"].get("dtype_reason", ""),
                                 hardware=hardware_line(v["engine"].get("hardware", {})),
                                 prepacked=bool(v["engine"].get("prepacked")),
                                 cpu_paths=v["engine"].get("cpu_paths", {}),
                                 exact=bool(v["engine"].get("exact", {}).get("exact")),
                                 exact_reason=v["engine"].get("exact", {}).get("why", ""),
                                 preemptions=v["batcher"].get("preemptions", 0), **v.get("kv", {}),
                                 **v.get("memory", {}),
                                 **{f"prefix_cache_{k}": n for k, n in v.get("prefix_cache", {}).items()})
            for name, st in ((v.get("policy") or {}).get("drafters") or {}).items():
                rep.policy.add(draft=name, gamma=st["gamma"], speculated_share=st["speculated_share"],
                               acceptance=st["accept_curve"], steps=st["steps"],
                               speculated_steps=st["speculated_steps"])
        for name, h in self.draft_handles.items():
            for d in await self.each(h, draft_deployment_name(name), "stats"):
                r.replicas.add(replica_id=d["replica_id"], role="draft", active_sequences=d["active_sequences"],
                               kv_slots_in_use=d["kv_slots_in_use"], kv_slots_total=d["kv_slots_total"])
        return r

    async def GetLoad(self, request, grpc_context=None) -> specd_pb2.LoadResponse:
        if self._refuses(grpc_context):
            return specd_pb2.LoadResponse()
        r = specd_pb2.LoadResponse()
        for v in await self.each(self.verifier, "Verifier", "load"):
            r.replicas.add(**v)
        return r

    async def Abort(self, request: specd_pb2.AbortRequest, grpc_context=None) -> specd_pb2.AbortResponse:
        """See `Router.abort`."""
        if self._refuses(grpc_context):
            return specd_pb2.AbortResponse()
        return specd_pb2.AbortResponse(aborted=await self.abort(list(request.request_ids)))

    async def ListModels(self, request, grpc_context=None) -> specd_pb2.ListModelsResponse:
        if self._refuses(grpc_context):
            return specd_pb2.ListModelsResponse()
        m = self.models()
        r = specd_pb2.ListModelsResponse(**{k: v for k, v in m.items() if k != "drafts"})
        for d in m["drafts"]:
            auto = d["default_gamma"] == "auto"
            r.drafts.add(name=d["name"], kind=d["kind"], default=d["default"], placement=d["placement"],
                         default_gamma=0 if auto else d["default_gamma"], default_gamma_auto=auto)
        return r

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1: service "" (the server) and "specd.v1.SpecDecode" are SERVING while a
        verifier replica is running (its models loaded), NOT_SERVING before and while none is;
        any other service name is NOT_FOUND. Read from the Serve controller, so a busy verifier
        (every slot streaming) still reads as serving."""
        from grpc_health.v1 import health_pb2

        if request.service not in HEALTH_SERVICES:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}; known: {list(HEALTH_SERVICES)}")
            return health_pb2.HealthCheckResponse()
        S = health_pb2.HealthCheckResponse
        status = S.SERVING if await self.serving() else S.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
