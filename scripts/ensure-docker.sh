#!/usr/bin/env bash
# Make sure a Docker engine answers, plus what the sandbox needs (debootstrap, ssh client).
# Installs Debian's docker.io if missing and starts dockerd in the background if none runs.
# Idempotent: does nothing when all is there. Needs root (or sudo) only when it must act.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

missing=()
command -v docker >/dev/null      || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ssh >/dev/null         || missing+=(openssh-client)
command -v rsync >/dev/null       || missing+=(rsync)
if ((${#missing[@]})); then
  echo "==> installing ${missing[*]} (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi
if ! command -v dockerd >/dev/null; then
  echo "docker CLI present but no dockerd to start; install docker.io or start your engine" >&2
  exit 1
fi
log=/var/log/nodeops-dockerd.log
[ -w "$(dirname "$log")" ] || log=/tmp/nodeops-dockerd.log
echo "==> starting dockerd (log: $log)"
$SUDO sh -c "nohup dockerd >'$log' 2>&1 &"
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "==> docker engine is up"; exit 0; fi
  sleep 1
done
echo "dockerd did not answer within 60s; last lines of $log:" >&2
tail -n 20 "$log" >&2 || true
exit 1
