"""The systemd unit that runs the holder on a node (installed by the Ansible `keepalive` role)."""

from __future__ import annotations

import shlex


def render_unit(python: str, extra_args: str = "", environment_file: str = "/etc/default/launch-keepalive") -> str:
    exec_start = f"{shlex.quote(python)} -m launch.keepalive.cli run {extra_args}".rstrip()
    return f"""\
[Unit]
Description=launch keepalive: hold idle GPUs, yield them only to Slurm jobs
# Start before slurmd so the first job's prolog finds the holder; restart learns
# running jobs' GPUs from slurmctld, so ordering after it is not required.
Before=slurmd.service
After=network-online.target munge.service
Wants=network-online.target

[Service]
Type=simple
EnvironmentFile=-{environment_file}
ExecStart={exec_start}
Restart=always
RestartSec=2
# Socket dir /run/launch-keepalive/ctl (0700) and the state file live here.
RuntimeDirectory=launch-keepalive
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
KillSignal=SIGTERM
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""
