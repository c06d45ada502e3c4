"""shared.openmp: the spin-wait a core-sharing worker gets, unless the user chose one."""

from __future__ import annotations

import pytest

from shared.openmp import SPINCOUNT, share_cores


def test_sets_the_spincount():
    env = {"PATH": "/bin"}
    assert share_cores(env) is True
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": SPINCOUNT}


@pytest.mark.parametrize(
    ("name", "value"), [("GOMP_SPINCOUNT", "0"), ("OMP_WAIT_POLICY", "ACTIVE")]
)
def test_a_users_choice_wins(name, value):
    env = {name: value}
    assert share_cores(env) is False
    assert env == {name: value}
