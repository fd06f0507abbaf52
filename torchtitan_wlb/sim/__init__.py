"""A 4D step simulator for WLB-LLM: packed micro-batches -> CP shards -> per-layer times -> pipeline.

It reuses the project's packers, CP planner and cost model. docs/simulator.md describes the model
and the command lines (``wlb-sim``, ``wlb-analyze``, ``python -m torchtitan_wlb.sim.calibrate``,
``.measure_cpu``, ``.reproduce``); docs/architecture.md lists the modules and what each may import.
"""
