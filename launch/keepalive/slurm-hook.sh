#!/bin/sh
# Slurm Prolog/Epilog wrapper for the launch keepalive holder, for nodes provisioned by the
# Ansible `keepalive` role. Install it twice, as .../launch-keepalive-prolog and
# .../launch-keepalive-epilog: slurm.conf's Prolog=/Epilog= take no arguments, so the hook
# is chosen by this file's name. slurmd runs it as root with a minimal environment; the
# venv's python and the socket come from /etc/default/launch-keepalive.
set -eu
[ -r /etc/default/launch-keepalive ] && . /etc/default/launch-keepalive
: "${LAUNCH_KEEPALIVE_PYTHON:=/opt/launch/venv/bin/python}"
export LAUNCH_KEEPALIVE_SOCKET LAUNCH_KEEPALIVE_TIMEOUT LAUNCH_KEEPALIVE_HOOK_LOG 2>/dev/null || true
case "$(basename "$0")" in
  *prolog*) hook=prolog ;;
  *epilog*) hook=epilog ;;
  *) echo "launch-keepalive hook: name must contain 'prolog' or 'epilog': $0" >&2; exit 2 ;;
esac
# a fixed working directory: `python -m` puts the current one first on sys.path
cd /
exec "$LAUNCH_KEEPALIVE_PYTHON" -m launch.keepalive.cli "$hook"
