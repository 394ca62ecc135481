"""The decode stage: :class:`DecodeWorker` receives each request's prompt KV from prefill into
pages it holds and decodes in one continuous batch; requests end through :mod:`.control` and
:mod:`.events`, and a room whose prefill server failed is re-dispatched by :mod:`.failover`."""

from .state import DecodeEvent
from .worker import DecodeWorker

__all__ = ["DecodeEvent", "DecodeWorker"]
