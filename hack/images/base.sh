#!/usr/bin/env bash
# Print the base image to build on: the official python image pinned by digest where it is
# present or can be pulled; otherwise an equivalent built here from Debian packages
# (debootstrap of bookworm with python3, from this machine's apt mirror), tagged once and reused.
set -euo pipefail
OFFICIAL=${PD_BASE_IMAGE:-python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91}
LOCAL=pd-local/python:3.11-bookworm

if docker image inspect "$OFFICIAL" >/dev/null 2>&1 || timeout 30 docker pull -q "$OFFICIAL" >/dev/null 2>&1; then
  echo "$OFFICIAL"
  exit 0
fi
if docker image inspect "$LOCAL" >/dev/null 2>&1; then
  echo "$LOCAL"
  exit 0
fi
mirror() {
  # the first Debian URI of the machine's apt configuration (deb822 or one-line format)
  local m
  m=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1 || true)
  [ -n "$m" ] || m=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' \
                     | grep -v security | head -1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}
M=$(mirror)
echo "[images] $OFFICIAL cannot be pulled here; building $LOCAL from Debian bookworm ($M)" >&2
ROOT=$(mktemp -d /tmp/pd-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$ROOT" "$M" >"$ROOT.log" 2>&1 || {
  echo "[images] debootstrap failed; the end of its log:" >&2; tail -20 "$ROOT.log" >&2; exit 1; }
rm -f "$ROOT.log"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
# python:3.11-slim's python is `python`; keep the same name here
ln -sf python3 "$ROOT/usr/bin/python"
tar -C "$ROOT" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$LOCAL" >/dev/null
echo "$LOCAL"
