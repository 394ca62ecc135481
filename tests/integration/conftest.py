import pytest
from kvpeer import PeerProcess


@pytest.fixture
def spawn():
    """spawn(side, entries, **config) -> PeerProcess; all are stopped at teardown."""
    procs = []

    def make(side, entries, seed=0, **config):
        config.setdefault("bootstrap_timeout_s", 20.0)
        config.setdefault("transfer_timeout_s", 60.0)
        p = PeerProcess(side, entries, config, seed)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()
