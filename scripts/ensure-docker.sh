#!/usr/bin/env bash
# Make sure a Docker engine answers, plus what the sandbox needs (debootstrap, ssh client).
# Decides on the engine, never on the client: many images ship a `docker` client binary with no
# engine, so "docker on PATH" says nothing. If `docker info` does not answer and no `dockerd`
# exists, Debian's docker.io is installed; then dockerd is started in the background.
# Idempotent: does nothing when all is there. Needs root (or sudo) only when it must act.
# NODEOPS_DOCKERD_LOG overrides where dockerd's log goes.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

engine_answers() { docker info >/dev/null 2>&1; }

missing=()
if ! engine_answers && ! command -v dockerd >/dev/null; then
  if command -v docker >/dev/null; then
    echo "==> a docker client is on PATH ($(command -v docker)) but no engine (dockerd): installing docker.io"
  fi
  missing+=(docker.io)
fi
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ssh >/dev/null         || missing+=(openssh-client)
command -v rsync >/dev/null       || missing+=(rsync)
if ((${#missing[@]})); then
  echo "==> installing ${missing[*]} (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if engine_answers; then
  exit 0
fi
if ! command -v dockerd >/dev/null; then
  echo "no Docker engine: docker info does not answer and dockerd is not installed (apt-get install docker.io)" >&2
  exit 1
fi
log=${NODEOPS_DOCKERD_LOG:-/var/log/nodeops-dockerd.log}
[ -w "$(dirname "$log")" ] || log=/tmp/nodeops-dockerd.log
echo "==> starting dockerd (log: $log)"
$SUDO sh -c "nohup dockerd >'$log' 2>&1 &"
for _ in $(seq 1 60); do
  if engine_answers; then echo "==> docker engine is up"; exit 0; fi
  sleep 1
done
echo "dockerd did not answer within 60s; last lines of $log:" >&2
tail -n 20 "$log" >&2 || true
exit 1
