"""SmartGen selective KV transfer: importance profile, Kr, proactive block plans, modes."""
from jkv.transfer.plan import MODES, STRATEGIES, TransferConfig, proactive_order, speculative_order
from jkv.transfer.profile import ImportanceProfile, ProfileBin, block_importance, compute_kr

__all__ = ["MODES", "STRATEGIES", "TransferConfig", "proactive_order", "speculative_order",
           "ImportanceProfile", "ProfileBin", "block_importance", "compute_kr"]
