"""The Responses API's `store` and `previous_response_id`, over the router's Responses service.

A stored response is one JSON value in the coldstore's LMDB (durable, per tenant, under the
store's cap and `--anonymous-ttl-s`): the response object as the client got it, and the
conversation's items up to it (every earlier input item, this request's input, then its
output). A request naming it as `previous_response_id` continues from those items: rendered as
one conversation, it finds its KV by its tokens, and where the KV is gone (retired, a new
machine) it is computed again. Instructions are not carried over, as OpenAI's API does not.
"""

from __future__ import annotations

import json
import logging

import grpc

from kvbank.apps.shim.errors import error_for
from kvbank.apps.shim.openai_format import ApiError
from kvbank.v1 import api_pb2

logger = logging.getLogger(__name__)


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response with id {response_id!r}: it was not stored (store: "
                         f"false), was deleted or retired, or belongs to another API key",
                    code="not_found", param=param)


async def load(stub, metadata, response_id: str, param: str | None = None) -> dict:
    """The stored value; 404 in OpenAI's shape when there is none."""
    try:
        got = await stub.Get(api_pb2.ResponseRef(id=response_id), metadata=metadata)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise _not_found(response_id, param) from None
        raise error_for(e) from None
    return json.loads(got.body)


async def prior_items(stub, metadata, body: object) -> list:
    """The items `previous_response_id` continues from (none without it)."""
    if not isinstance(body, dict) or body.get("previous_response_id") is None:
        return []
    rid = body["previous_response_id"]
    if not isinstance(rid, str) or not rid:
        raise ApiError(400, "previous_response_id must be a response's id",
                       param="previous_response_id")
    stored = await load(stub, metadata, rid, param="previous_response_id")
    return stored["items"] + stored["response"]["output"]


def input_items(body: dict, prior: list) -> list:
    """The conversation's items up to this request's answer: the earlier ones, then its input
    (a string is one user message)."""
    given = body.get("input")
    return prior + ([{"role": "user", "content": given}] if isinstance(given, str)
                    else list(given or []))


async def keep(stub, metadata, items: list, response: dict) -> None:
    """Store the answered response with its items (durable on return). A store that fails is
    logged; the answer stands."""
    value = json.dumps({"items": items, "response": response}, ensure_ascii=False)
    try:
        await stub.Put(api_pb2.StoredResponse(id=response["id"], created_at=response["created_at"],
                                              body=value.encode()), metadata=metadata)
    except grpc.aio.AioRpcError as e:
        logger.warning("response %s not stored: %s: %s", response["id"], e.code().name,
                       e.details())


async def delete(stub, metadata, response_id: str) -> dict:
    try:
        got = await stub.Delete(api_pb2.ResponseRef(id=response_id), metadata=metadata)
    except grpc.aio.AioRpcError as e:
        raise error_for(e) from None
    if not got.deleted:
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
