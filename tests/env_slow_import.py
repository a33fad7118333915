"""An environment whose module takes 4 s to import (tests/test_env_pool.py: a worker's start does not
count against the first call's timeout)."""
from __future__ import annotations

import time

from env_faults import Faulty

time.sleep(4.0)


class SlowStart(Faulty):
    """Faulty, in a module slow to import."""
