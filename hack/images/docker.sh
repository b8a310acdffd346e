#!/usr/bin/env bash
# Make sure a Docker engine answers: install Debian's docker.io (and debootstrap, for the base
# image) where it is missing, and start dockerd with host networking only (no bridge, no
# iptables rules), so containers bind loopback like the rest of the local cluster.
# Prints nothing on success but "[docker] ..." progress lines; exits non-zero saying what is missing.
set -euo pipefail
STATE=${PD_DOCKER_STATE:-${PD_CACHE_DIR:-$HOME/.cache/pd-operator}/docker}
SOCK=${PD_DOCKER_SOCK:-/var/run/docker.sock}

if docker -H "unix://$SOCK" info >/dev/null 2>&1; then
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[docker] no Docker engine: install docker.io and debootstrap (Debian: apt-get install docker.io debootstrap)," \
         "or start dockerd yourself" >&2
    exit 2
  fi
  echo "[docker] installing Debian's docker.io and debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
fi
mkdir -p "$STATE"
echo "[docker] starting dockerd (host network only; log $STATE/dockerd.log)"
# A stale pid file from a dockerd that is gone would stop a new one from starting.
rm -f /var/run/docker.pid
nohup dockerd --host "unix://$SOCK" --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
  --storage-driver overlay2 >"$STATE/dockerd.log" 2>&1 &
for _ in $(seq 1 60); do
  if docker -H "unix://$SOCK" info >/dev/null 2>&1; then
    exit 0
  fi
  sleep 1
done
echo "[docker] dockerd did not answer within 60 s; the end of its log:" >&2
tail -20 "$STATE/dockerd.log" >&2
exit 1
