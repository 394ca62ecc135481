"""One prefill server as seen from a decode server: Triton gRPC (tritonclient's generated
stubs) for forwarded requests and readiness, its metrics endpoint for the queue it holds.

A forwarded request is ONE ``ModelStreamInfer`` call (its own HTTP/2 stream on the server's
shared channel), so an error response belongs to exactly that request. The prefill model answers
at once with the request carrying its bootstrap address (the *answer*); the call then stays open
until prefill is done with the room (an empty final response), or breaks when the server dies.
"""

from __future__ import annotations

import logging
import queue
import re
import struct
import threading
import urllib.request
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .. import errors
from .. import request as rq
from ..fingerprint import PARAM, from_labels
from ..metrics import INFO

PREFILL_MODEL = "prefill"
QUEUE_METRIC = "pd_queued_prompt_tokens"
CACHE_METRIC = "pd_prefix_lookup_tokens_total"  # exported by a stage with a prefix cache only
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LEN = struct.Struct("<I")  # Triton's BYTES element: 4-byte little-endian length, then bytes

log = logging.getLogger(__name__)


class Refused(RuntimeError):
    """The server did not take the request. ``down``: it is unreachable or hung (mark it down);
    else it answered with an error and stays up. ``tag``: that error's kind, param and code
    (``errors.parse_tag`` of the server's message: overloaded, invalid, an incompatible
    deployment's code; ``internal`` for a message without a tag, a broken call's among them)."""

    def __init__(self, message: str, down: bool):
        super().__init__(message)
        self.down = down
        self.tag = errors.parse_tag(message)


def infer_request(req: rq.StageRequest, fingerprint: str = "") -> service_pb2.ModelInferRequest:
    """``fingerprint``: the router's deployment fingerprint (JSON), checked by prefill."""
    r = service_pb2.ModelInferRequest(model_name=PREFILL_MODEL, id=str(req.room))
    if fingerprint:
        r.parameters[PARAM].string_param = fingerprint
    t = r.inputs.add()
    t.name, t.datatype = rq.REQUEST_TENSOR, "BYTES"
    t.shape.append(1)
    data = rq.encode(req)
    r.raw_input_contents.append(_LEN.pack(len(data)) + data)
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    r.parameters[rq.HOLD_PARAM].bool_param = True
    return r


def answer_of(resp: service_pb2.ModelInferResponse) -> rq.StageRequest | None:
    """The request in a response (None for the empty final one)."""
    if not resp.raw_output_contents:
        return None
    raw = resp.raw_output_contents[0]
    (n,) = _LEN.unpack_from(raw)
    return rq.decode(raw[_LEN.size : _LEN.size + n])


def is_final(resp: service_pb2.ModelInferResponse) -> bool:
    p = resp.parameters.get("triton_final_response")
    return bool(p and p.bool_param)


class Forward:
    """One forwarded request: ``answer(timeout)`` waits for the prefill server's first response;
    ``on_end(error, down)`` runs once when the call ends (error ``None``: prefill finished the
    room; ``down``: the connection broke, i.e. the server died or became unreachable)."""

    def __init__(
        self, stub, req: rq.StageRequest, on_end: Callable[[str | None, bool], None], fp: str = ""
    ):
        self.name = f"forward of room {req.room}"
        self._first: queue.Queue = queue.Queue(maxsize=1)
        self._done = threading.Event()
        self._on_end = on_end
        self._call = stub.ModelStreamInfer(self._requests(infer_request(req, fp)))
        threading.Thread(target=self._pump, name=f"fwd-{req.room}", daemon=True).start()

    def _requests(self, msg):
        yield msg
        self._done.wait()  # keep the stream open (no half-close) until prefill is done

    def answer(self, timeout: float) -> rq.StageRequest:
        try:
            kind, value = self._first.get(timeout=timeout)
        except queue.Empty:
            self.cancel()
            raise Refused(f"no answer in {timeout:g}s (hung?)", down=True) from None
        if kind == "ok":
            return value
        raise Refused(value, down=kind == "down")

    def cancel(self) -> None:
        self._call.cancel()

    def _pump(self) -> None:
        answered, down, err = False, False, "stream ended before prefill finished the room"
        try:
            for resp in self._call:
                if resp.error_message:
                    err = resp.error_message
                    break
                ans = answer_of(resp.infer_response)
                if ans is not None and not answered:
                    answered = True
                    self._first.put(("ok", ans))
                if is_final(resp.infer_response):
                    err = None
                    break
        except grpc.RpcError as e:
            err, down = f"{e.code().name}: {e.details()}", e.code() != grpc.StatusCode.CANCELLED
            if not answered:
                self._first.put(("down", err))
                answered = True
        except Exception as e:  # a garbled answer: this request only
            err = f"bad answer: {e}"
            log.warning("%s: %s", self.name, err)
        finally:
            if not answered:
                self._first.put(("error", err or "finished without an answer"))
            self._done.set()
            self._call.cancel()
            try:
                self._on_end(err, down)
            except Exception:  # never kills the pump, never silent: failover depends on it
                log.exception("%s: handling its end (error: %s) failed", self.name, err)


class PrefillClient:
    """gRPC channel + metrics URL of one prefill server."""

    def __init__(self, host: str, grpc_port: int, metrics_port: int):
        self.name = f"{host}:{grpc_port}"
        self.metrics_url = f"http://{host}:{metrics_port}/metrics"
        opts = [  # a restarted server is reachable again within a second, not after minutes
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.channel = grpc.insecure_channel(self.name, options=opts)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.fingerprint = ""  # ours (JSON), sent with every forward; the router sets it
        self.remote_fingerprints: list = []  # the server's, from its last metrics read
        self.caches = True  # its prefill instances keep a prefix cache (they export its metric)

    def forward(self, req: rq.StageRequest, on_end: Callable[[str | None, bool], None]) -> Forward:
        return Forward(self.stub, req, on_end, self.fingerprint)

    def ready(self, timeout: float) -> bool:
        """The server and its prefill model are ready (False on any error)."""
        try:
            r = self.stub.ModelReady(
                service_pb2.ModelReadyRequest(name=PREFILL_MODEL), timeout=timeout
            )
            return bool(r.ready)
        except grpc.RpcError:
            return False

    def queued_tokens(self, timeout: float) -> float:
        """Prompt tokens the server's prefill instances hold (its queue metric, summed). Also
        reads the instances' deployment fingerprints (``remote_fingerprints``)."""
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as r:
            text = r.read().decode()
        self.remote_fingerprints = [
            from_labels(dict(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0])))
            for line in text.splitlines()
            if line.startswith(INFO.name + "{")
        ]
        self.caches = any(line.startswith(CACHE_METRIC) for line in text.splitlines())
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(QUEUE_METRIC + "{") or line.startswith(QUEUE_METRIC + " ")
        )

    def close(self) -> None:
        self.channel.close()
