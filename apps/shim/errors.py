"""The router's refusals as HTTP errors (OpenAI's shape; Anthropic's routes reshape them)."""

from __future__ import annotations

import logging

import grpc

from kvbank.apps.shim.openai_format import ApiError
from kvbank.contracts.failures import HTTP_STATUS, failure_for
from kvbank.contracts.vocabulary import NO_RETRY_VERDICTS

logger = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER_S = 1.0  # when the router's refusal carries no `retry-after`
# The router's refusals carry `x-kvbank-reason` (our error code) and `x-kvbank-verdict`; a
# verdict in NO_RETRY_VERDICTS (kvbank/contracts/vocabulary.py) says a retry cannot help.
# A gRPC status that stands for a failure of kvbank/contracts/failures.py gets that failure's
# HTTP status, OpenAI error type and code (HTTP_STATUS, the one table). Any other status is a
# 500 with a plain message; the details go to the log, not the client.
INTERNAL = (500, "server_error", "internal_error")


def error_for(e: grpc.aio.AioRpcError) -> ApiError:
    failure = failure_for(e.code())
    status, kind, code = HTTP_STATUS[failure] if failure is not None else INTERNAL
    if status == 500:
        logger.error("router call failed: %s: %s", e.code().name, e.details())
        return ApiError(500, "kvbank failed to answer (internal error); the server log says why",
                        type=kind, code=code)
    md = e.trailing_metadata() or grpc.aio.Metadata()
    busy = status in (429, 503)
    hopeless = busy and md.get("x-kvbank-verdict") in NO_RETRY_VERDICTS  # retrying can't help
    retry_after_s = _seconds(md.get("retry-after")) if busy and not hopeless else None
    return ApiError(status, e.details() or e.code().name, type=kind,
                    code=md.get("x-kvbank-reason") or code, retry_after_s=retry_after_s,
                    retry=False if hopeless else None, param=md.get("x-kvbank-param"))


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S
