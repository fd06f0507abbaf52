"""``python -m torchtitan_wlb.sim``: the ``wlb-sim`` command line."""

from torchtitan_wlb.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
