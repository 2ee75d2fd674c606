"""The backend contract (tests/contract) over Ray actors: its Ray cases, run inside a
loopback-only network namespace, as the other Ray tests are (see conftest.py)."""

from __future__ import annotations

import pytest

from ..helpers import within
from .conftest import INSIDE, REPO, run_inside_a_namespace


@pytest.mark.skipif(INSIDE, reason="this is the outer test")
@pytest.mark.timeout(720)
def test_ray_actors_pass_the_backend_contract() -> None:
    # A hang guard: each case starts two actors per pass, seconds each on the 2-core machine.
    run_inside_a_namespace([REPO / "tests" / "contract"], within(700))
