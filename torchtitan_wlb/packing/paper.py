"""The paper's published packing figures (WLB-LLM, OSDI '25), one copy for ``pack_bench --table2``
and the reproduction page."""

# Table 2 (7B, 128K context): (method, config, imbalance, overhead); wlb is this project's packer.
PAPER_TABLE2 = (
    ("original", "-", 1.44, "0 ms"),
    ("fixed_greedy", "G=1", 1.41, "4-5 ms"),
    ("fixed_greedy", "G=2", 1.22, "4-5 ms"),
    ("fixed_greedy", "G=4", 1.11, "4-5 ms"),
    ("fixed_greedy", "G=8", 1.08, "4-5 ms"),
    ("solver", "G=1", 1.40, "467 ms"),
    ("solver", "G=2", 1.18, "1.5 s"),
    ("solver", "G=4", 1.09, "25 s"),
    ("wlb_paper", "1 queue", 1.24, "8 ms"),
    ("wlb_paper", "2 queues", 1.05, "20 ms"),
    ("wlb_paper", "3 queues", 1.05, "23 ms"),
    ("wlb", "3 queues", None, "-"),
)
PAPER_T2_ORIGINAL = next(imb for method, _, imb, _ in PAPER_TABLE2 if method == "original")
"""Table 2's imbalance of the original (TorchTitan-style) packing."""
