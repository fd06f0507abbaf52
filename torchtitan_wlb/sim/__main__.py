"""``python -m torchtitan_wlb.sim``: the ``wlb-sim`` command line (:mod:`torchtitan_wlb.sim.cli`)."""

import sys

from torchtitan_wlb.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
