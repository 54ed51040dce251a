"""Quality suite: perplexity against measured KV bytes for the retention policies and their peers
(``kv_quality``, its scenarios ``kv_scenarios`` and budget shapes ``kv_budget_shapes``), weight
quantization (``weights_quality``), lm-eval against the server (``eval_lm``) and the perplexity
protocols (``protocol_check``)."""

QUICK = [["bench.quality.kv_quality", "--quick", "--no-ablations"]]
