"""Free ports for private stacks (devstack/free_ports.py): under pytest-xdist each test process
picks from its own residue class, so two processes starting their stacks at the same moment
never pick the same port (CI lost a whole process's stack to "address already in use")."""

from __future__ import annotations

import pytest

from devstack import free_ports


@pytest.mark.parametrize("worker", [0, 1, 3])
def test_each_test_process_picks_ports_of_its_own_class(
    monkeypatch: pytest.MonkeyPatch, worker: int
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    ports = [free_ports.free_port() for _ in range(50)]
    assert {port % 4 for port in ports} == {worker}
    assert len(set(ports)) == 50 and all(10000 <= port < 65535 for port in ports)


def test_outside_xdist_any_port_may_be_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert free_ports._process_share() == (0, 1)
    assert len({free_ports.free_port() % 4 for _ in range(200)}) > 1
