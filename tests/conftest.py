"""Test-suite set-up: CPU support must be active before anything imports torchtitan."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_wlb import cpu_support  # noqa: E402

cpu_support.activate()
