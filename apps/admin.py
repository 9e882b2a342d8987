"""`kvbank admin ...`: operator tools, one RPC each, answers printed as JSON. With the
operator's key (`--admin-key`) they act on every tenant; with an API key (`--api-key`), on
that tenant's own conversations (pressure is the operator's alone)."""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from kvbank.apps.status import key_hint
from kvbank.client import Client


def run_admin(args) -> int:
    with Client(args.address, args.api_key, args.admin_key) as c:
        try:
            if args.admin == "pressure":
                reply = c.set_pressure(args.level)
            elif args.admin == "trim":
                reply = c.trim()
            elif args.admin == "flush":
                reply = c.flush()
            else:
                reply = c.release(args.session, write_out=not args.no_write_out,
                                  tenant=args.tenant)
        except grpc.RpcError as e:
            print(f"kvbank admin {args.admin}: {e.code().name}: {e.details()}{key_hint(e)}",
                  file=sys.stderr)
            return 1
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True)))
    return 0
