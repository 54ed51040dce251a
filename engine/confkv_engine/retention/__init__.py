"""CONF-KV token-level KV retention: confidence scoring, FULL/KEY_ONLY/DISCARD tiers, peer policies.

- ``scorer``: pure signal -> confidence functions (formulas in its docstring).
- ``tiers``: pure tier decisions and the byte accounting of the budget.
- ``policies``: full / streaming / h2o / conf-kv as selection functions, selectable by name.
- ``value_merge``: the KEY_ONLY value stand-in and attention over FULL/KEY_ONLY slots.
"""

from confkv_engine.retention.policies import POLICY_NAMES, RetentionConfig
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig

__all__ = ["POLICY_NAMES", "KVAccounting", "RetentionConfig", "ScorerConfig", "Tier", "TierConfig"]
