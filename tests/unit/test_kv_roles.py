"""The role contracts (kvtransfer/roles.py) are what KVSender and KVReceiver implement: every
method of a contract exists on its class with the same parameters, in the same order."""

import inspect

import pytest

from kvtransfer import KVReceiver, KVSender, Receiver, Sender


def members(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("protocol, cls", [(Sender, KVSender), (Receiver, KVReceiver)])
def test_each_role_is_implemented_with_the_contract_s_parameters(protocol, cls):
    names = members(protocol)
    assert len(names) >= 9
    for name in names:
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} vs contract {want}"
