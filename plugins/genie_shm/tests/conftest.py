"""shm tests (and the node processes they start) use their own cache directory, never the user's."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    os.environ["GENIE_CACHE_DIR"] = tempfile.mkdtemp(prefix="genie-shm-test-cache-")
