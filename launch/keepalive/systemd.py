"""The systemd unit that runs the holder on a node (installed by the Ansible `keepalive` role)."""

from __future__ import annotations

import shlex

from launch.errors import LaunchError


def render_unit(python: str, extra_args: str = "", environment_file: str = "/etc/default/launch-keepalive") -> str:
    if not python.startswith("/"):
        raise LaunchError(f"--python {python!r} must be an absolute path; systemd runs ExecStart without a PATH search")
    for name, value in (("--python", python), ("--args", extra_args)):
        if any(ord(c) < 0x20 or c == "\x7f" for c in value):
            # a newline would end ExecStart= and start another directive of the unit
            raise LaunchError(f"{name} {value!r} has a control character; give one line of arguments")
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
