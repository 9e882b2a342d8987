"""The public calls the router passes to the worker as they are, in the caller's tenant or
scope: sessions, the Responses API's stored responses, and the operator's tools. What they
share with generation (the channel, the tenant, the error mapping) is the Backend's
(router/server.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from kvbank.contracts.failures import KvbankError, grpc_status
from kvbank.router.auth import ADMIN_KEY, OPERATOR
from kvbank.v1 import api_pb2_grpc

if TYPE_CHECKING:
    from kvbank.router.server import Backend


class SessionsServicer(api_pb2_grpc.SessionsServicer):
    def __init__(self, backend: Backend):
        self.b = backend

    async def _call(self, method, request, context):
        return await self.b.forward(method, request, context, timeout_s=30)

    async def List(self, request, context):
        """The caller's own sessions; with the operator's key, every tenant's."""
        scope = ...
        if ADMIN_KEY in dict(context.invocation_metadata()):
            try:
                scope = self.b.scope(context)
            except KvbankError as e:
                await context.abort(grpc_status(e), str(e))
        return await self.b.forward(self.b.stub.ListSessions, request, context, 30, scope=scope)

    async def Get(self, request, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty: name a session")
        return await self._call(self.b.stub.GetSession, request, context)

    async def Delete(self, request, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty: name a session")
        return await self._call(self.b.stub.DeleteSession, request, context)


class ResponsesServicer(api_pb2_grpc.ResponsesServicer):
    """The Responses API's stored responses, relayed to the worker in the caller's tenant."""

    def __init__(self, backend: Backend):
        self.b = backend

    async def _call(self, method, request, context):
        if not request.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "id is empty: name a response")
        return await self.b.forward(method, request, context, timeout_s=30)

    async def Put(self, request, context):
        return await self._call(self.b.stub.PutResponse, request, context)

    async def Get(self, request, context):
        return await self._call(self.b.stub.GetResponse, request, context)

    async def Delete(self, request, context):
        return await self._call(self.b.stub.DeleteResponse, request, context)


class AdminServicer(api_pb2_grpc.AdminServicer):
    """Operator tools, relayed to the worker in the caller's scope (router/auth.py
    `operator_or_tenant`): the operator's call acts on every tenant, a tenant's on its own
    conversations; pressure acts on the whole server, so it is the operator's alone."""

    def __init__(self, backend: Backend):
        self.b = backend

    async def _scope(self, context) -> str | None:
        try:
            return self.b.scope(context)
        except KvbankError as e:
            await context.abort(grpc_status(e), str(e))

    async def _relay(self, method, request, context, timeout_s: float = 120):
        scope = await self._scope(context)
        return await self.b.forward(method, request, context, timeout_s, scope=scope)

    async def SetPressure(self, request, context):
        if await self._scope(context) is not OPERATOR:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "SetPressure acts on every tenant's conversations: it needs "
                                "the operator key (the router's --admin-key, sent as "
                                "x-kvbank-admin-key)")
        return await self._relay(self.b.stub.SetPressure, request, context)

    async def Trim(self, request, context):
        return await self._relay(self.b.stub.Trim, request, context)

    async def Flush(self, request, context):
        return await self._relay(self.b.stub.Flush, request, context)

    async def Status(self, request, context):
        return await self._relay(self.b.stub.Status, request, context)

    async def Release(self, request, context):
        scope = await self._scope(context)
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty: name a session")
        tenant = request.tenant if scope is OPERATOR else scope
        if scope is not OPERATOR and request.tenant not in ("", scope):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "releasing another tenant's conversation needs the operator "
                                "key (the router's --admin-key, sent as x-kvbank-admin-key)")
        return await self.b.forward(self.b.stub.Release, request, context, timeout_s=60,
                                    scope=tenant)
