"""A 4D step simulator for WLB-LLM: packed micro-batches -> CP shards -> per-layer times -> pipeline.

It reuses the project's packers, CP planner and cost model (docs/simulator.md). Modules, bottom up:
``presets``, ``lengths``, ``hardware`` and ``modes`` (what is simulated and compared); ``timeline``
(1F1B pipelines) and ``timing`` (one layer's compute and communication); ``config`` (SimConfig);
``records`` and ``fit`` (measured times and their least-squares fit); ``integration`` (packers, CP
plans, cost model); ``engine`` (``simulate_mode``); ``plots``. Command lines: ``cli`` (``wlb-sim``,
``python -m torchtitan_wlb.sim``), ``analyze`` (``wlb-analyze``), ``calibrate``, ``measure_cpu`` and
``reproduce`` (``python -m torchtitan_wlb.sim.<name>``).
"""
