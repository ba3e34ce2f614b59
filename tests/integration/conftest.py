"""Integration-test hygiene shared by every module.

Several modules fork hivemind DHT processes inside the pytest process after earlier modules
ran grpc.aio servers and thread pools there. An unreachable object whose finalizer joins a
thread of the parent (that thread does not exist in a forked child) then hangs the child the
first time its garbage collector runs. Collecting garbage in the parent before each module
finalizes such objects where their threads still exist.
"""

import gc

import pytest


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_before_forking():
    gc.collect()
    yield
    gc.collect()
