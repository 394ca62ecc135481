"""scripts/health.py's verdict on a metrics page: who is not ready, and why."""

from __future__ import annotations

from scripts import health


def test_verdict_names_the_cause():
    ready = 'pd_ready{stage="decode",instance="decode_0"} 1\n'
    assert health.verdict(ready) is None
    router = (
        'pd_ready{stage="decode",instance="router_0"} 0\n'
        'pd_router_server_incompatible{server="127.0.0.1:8101"} 1\n'
        'pd_router_server_up{server="127.0.0.1:8101"} 1\n'
        'pd_router_server_up{server="127.0.0.1:8201"} 0\n'
    )
    why = health.verdict(router)
    assert "router_0: no compatible prefill server is up" in why
    assert "127.0.0.1:8101: incompatible deployment" in why and "127.0.0.1:8201: down" in why
    prefill = 'pd_ready{stage="prefill",instance="prefill_0"} 0\n'
    assert "KV transfer endpoint is down" in health.verdict(prefill)
