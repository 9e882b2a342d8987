"""Is a process up? The checks the supervisor, the benchmarks and the tests share: gRPC's
standard health service for the router and the worker, a ping over ZeroMQ for the coldstore."""

from __future__ import annotations


def listening(address: str) -> bool:
    """Whether anything accepts a connection at a gRPC (`unix://PATH`, `HOST:PORT`) or ZeroMQ
    (`ipc://PATH`) address. A start is polled twenty times a second, and a gRPC channel to a
    peer that is not there yet costs milliseconds of CPU where a refused connect costs
    microseconds. Only a refused connect says no: anything else, the real check decides."""
    import socket

    for scheme in ("unix://", "ipc://"):
        if address.startswith(scheme):
            family, target = socket.AF_UNIX, address[len(scheme):]
            break
    else:
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            return True
        family, target = socket.AF_INET6 if ":" in host else socket.AF_INET, \
            (host.strip("[]"), int(port))
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(target)
        except (ConnectionRefusedError, FileNotFoundError):
            return False  # nothing listens there: the one answer taken from this check
        except OSError:
            pass  # another error (a wildcard address, a timeout): the real check decides
    return True


def grpc_healthy(address: str, timeout_s: float = 1.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if not listening(address):
        return False
    try:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


PING_REQ = 1  # a ping's socket sends this one request


def coldstore_ping(address: str, timeout_ms: int = 1000):
    """The coldstore's answer to a ping (a coldstore_pb2.PingReply: store stats, worker state,
    queued jobs), or None when it does not answer in time, or answers something else."""
    import zmq

    from kvbank.contracts import coldstore_wire as wire

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)  # its own identity: the worker's link is not disturbed
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(address)
        s.send_multipart(wire.encode(wire.request(PING_REQ, ping=wire.pb.Ping())))
        if not s.poll(timeout_ms):
            return None
        try:
            msg, _ = wire.decode(s.recv_multipart())
        except Exception:  # not a coldstore of this protocol
            return None
        reply = msg.reply
        if msg.WhichOneof("kind") != "reply" or not reply.ok or reply.req != PING_REQ:
            return None
        return reply.ping
    finally:
        s.close()


def coldstore_up(address: str) -> bool:
    return listening(address) and coldstore_ping(address) is not None
