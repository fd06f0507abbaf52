"""The 4D step simulator of WLB-LLM and its command lines (docs/simulator.md)."""
