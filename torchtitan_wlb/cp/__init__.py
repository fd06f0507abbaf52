"""Context parallelism for packed documents: sharding plans, profile tables and the CP attention op
(``cp.op`` and ``cp.local``, which import torch, are imported where a process group exists).
"""

from torchtitan_wlb.cp.adaptive import build_cp_plan
from torchtitan_wlb.cp.profile import CPProfile, default_profile

__all__ = ["CPProfile", "build_cp_plan", "default_profile"]
