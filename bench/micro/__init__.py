"""Micro suite: single pieces measured outside the serving path: decode attention kernels
(``decode_attention``), a profiled engine step (``profile_step``), a profiled decode under precision
tiers (``profile_tiers_decode``) and the structured-output mask (``grammar_mask_cost``)."""

QUICK = [["bench.micro.decode_attention", "--context", "512", "--batches", "1,8"],
         ["bench.micro.profile_step", "--weights", "fp32", "--steps", "3",
          "--out", "bench/results/micro/profile-quick.json"]]
