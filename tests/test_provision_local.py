"""The README's plain-LXC path, exactly as written: `make provision host=localhost`.

Real, all of it: make, the shipped inventory/local.yml, Ansible, Debian's LXC, debootstrap
from the Debian mirror, systemd as the container's init, apt and pip inside the container
over the host's network, Slurm (slurmctld, slurmd, slurmdbd) with munge and MariaDB. The
container is the controller and the node: a job runs there, and sacct reads it COMPLETED.

It changes this machine as the README says it does (/var/lib/lxc/launch-local,
/var/lib/launch-scratch) and removes both afterwards; it is skipped where that container
already exists, without root, LXC, debootstrap or the network, or where `make provision`
would first have to reinstall the venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ansible_fixtures import REPO, destroy_container, lxc_attach

LXC_PATH = Path("/var/lib/lxc")
NAME = "launch-local"
SCRATCH = Path("/var/lib/launch-scratch")


def _network() -> bool:
    try:
        urllib.request.urlopen("http://deb.debian.org/debian/dists/bookworm/Release", timeout=10).close()
        urllib.request.urlopen("https://pypi.org/simple/submitit/", timeout=10).close()
        return True
    except OSError:
        return False


@pytest.mark.lxc
@pytest.mark.slow
def test_readme_plain_lxc_path_provisions_a_working_slurm_node() -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("lxc-start", "lxc-attach", "debootstrap", "make")):
        pytest.skip("needs root, Debian's lxc and debootstrap")
    if (LXC_PATH / NAME).exists() or SCRATCH.exists():
        pytest.skip(f"{LXC_PATH / NAME} or {SCRATCH} exists already (someone's trial); not touching it")
    if not _network():
        pytest.skip("the plain-LXC path installs from the Debian mirror and PyPI; no network here")
    venv = Path(sys.executable).parent.parent
    env = {**os.environ, "VENV": str(venv)}
    if subprocess.run(["make", "-q", f"{venv}/.installed"], cwd=REPO, env=env).returncode != 0:
        pytest.skip("`make provision` would reinstall the venv first (pyproject.toml is newer); run `make deps`")
    try:
        proc = subprocess.run(["make", "provision", "host=localhost"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

        def inside(script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            return lxc_attach(LXC_PATH, NAME, script, check=check)

        assert inside("readlink /proc/1/exe").stdout.strip().endswith("systemd")  # the image has an init
        for unit in ("munge", "mariadb", "slurmdbd", "slurmctld", "slurmd"):
            logs = f"journalctl -n 30 --no-pager -u {unit}; tail -n 30 /var/log/slurm/*.log"
            assert inside(f"systemctl is-active {unit}", check=False).stdout.strip() == "active", \
                inside(logs, check=False).stdout[-3000:]
        job = inside("cd /tmp && sbatch --parsable --wrap 'hostname'").stdout.strip()
        assert job.isdigit(), job
        state = ""
        for _ in range(120):
            state = inside(f"sacct -n -X -P -j {job} -o State", check=False).stdout.strip()
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(1)
        assert state == "COMPLETED", inside("sinfo; squeue; tail -20 /var/log/slurm/*.log", check=False).stdout
    finally:
        destroy_container(LXC_PATH, NAME)
        shutil.rmtree(LXC_PATH / NAME, ignore_errors=True)
        shutil.rmtree(SCRATCH, ignore_errors=True)
