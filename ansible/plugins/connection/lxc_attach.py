"""Run tasks inside a local LXC container through `lxc-attach`.

Why this and not community.general.lxc or ssh (see ansible/README.md): it needs no Python
bindings (PyPI `lxc`, built against liblxc-dev), no network in the container, and no sshd or
keys inside it; only the `lxc-attach` binary that every LXC host already has.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes

from ansible.plugins.connection import ConnectionBase

DOCUMENTATION = r"""
name: lxc_attach
short_description: Run tasks in a local LXC container with lxc-attach
description:
  - Runs commands inside a running container on the controller host with C(lxc-attach),
    and moves files through the attached shell's stdin/stdout. Needs root on the controller.
author: gpu-train-toolkit
options:
  remote_addr:
    description: The container name.
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: lxc_attach_name
  lxc_path:
    description: The LXC path (C(lxc-attach -P)); where the container's directory lives.
    default: /var/lib/lxc
    vars:
      - name: lxc_attach_lxc_path
  executable:
    description: Shell used inside the container.
    default: /bin/sh
    vars:
      - name: ansible_executable
"""

# A clean, fixed environment inside the container: the controller's variables must not leak in.
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Connection(ConnectionBase):
    """lxc-attach based connection to a container on this host."""

    transport = "lxc_attach"
    has_pipelining = True
    default_user = "root"

    def _connect(self) -> Connection:
        if os.geteuid() != 0:
            raise AnsibleConnectionFailure("lxc_attach needs root on the controller (lxc-attach of a privileged container)")
        self._lxc_attach = shutil.which("lxc-attach")
        if not self._lxc_attach:
            raise AnsibleConnectionFailure("lxc-attach not found; install Debian's lxc package")
        if not self._connected:
            super()._connect()
            self._connected = True
        return self

    def _attach_argv(self, cmd: str) -> list[bytes]:
        argv = [
            self._lxc_attach, "-P", self.get_option("lxc_path"), "-n", self.get_option("remote_addr"),
            "--clear-env", "-v", f"PATH={CONTAINER_PATH}", "-v", "HOME=/root", "-v", "LANG=C.UTF-8",
            "--", self.get_option("executable"), "-c", cmd,
        ]
        return [to_bytes(a, errors="surrogate_or_strict") for a in argv]

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = False):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        self._connect()
        proc = subprocess.run(self._attach_argv(cmd), input=in_data, capture_output=True, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        self._connect()
        if not os.path.exists(to_bytes(in_path, errors="surrogate_or_strict")):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        with open(to_bytes(in_path, errors="surrogate_or_strict"), "rb") as source:
            proc = subprocess.run(self._attach_argv(f"cat > {shlex.quote(out_path)}"), stdin=source,
                                  capture_output=True, check=False)
        if proc.returncode != 0:
            raise AnsibleError(f"failed to put {in_path} to {out_path}: {proc.stderr.decode(errors='replace')}")

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        self._connect()
        with open(to_bytes(out_path, errors="surrogate_or_strict"), "wb") as target:
            proc = subprocess.run(self._attach_argv(f"cat {shlex.quote(in_path)}"), stdout=target,
                                  stderr=subprocess.PIPE, check=False)
        if proc.returncode != 0:
            raise AnsibleError(f"failed to fetch {in_path}: {proc.stderr.decode(errors='replace')}")

    def close(self) -> None:
        super().close()
        self._connected = False
