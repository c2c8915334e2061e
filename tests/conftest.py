"""What a test may ask of the session itself: how many tests it collected, when it collected the whole suite."""
from __future__ import annotations

from pathlib import Path

import pytest

DESELECTED = pytest.StashKey[int]()


def pytest_deselected(items):
    """-k, -m, --deselect and --last-failed drop collected items here; the suite's count includes them."""
    if items:
        session = items[0].session
        session.stash[DESELECTED] = session.stash.get(DESELECTED, 0) + len(items)


@pytest.fixture
def whole_suite_collected(request) -> int | None:
    """The number of tests this session collected when it collected all of tests/ (as `make test` does), the
    number `pytest --collect-only tests` prints; None when it collected less (a file, a node, an --ignore)."""
    config, session = request.config, request.session
    args = [(config.invocation_params.dir / arg).resolve() for arg in config.args]
    if args != [Path(__file__).resolve().parent] or config.getoption("ignore") or config.getoption("ignore_glob"):
        return None
    return session.testscollected + session.stash.get(DESELECTED, 0)
