"""WLB-LLM workload-balanced 4D parallelism as a TorchTitan extension."""

__version__ = "0.1.0"
