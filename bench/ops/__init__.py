"""Operations suite: the operator against the Kubernetes API emulator, one CR and a burst of CRs
(``operator``)."""

QUICK = [["bench.ops.operator", "--count", "10", "--out", "bench/results/ops/operator-quick.json"]]
