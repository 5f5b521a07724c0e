"""The Proxmox backend against the state-only `pct` stand-in (tests/pve_backend.py): the GPU
device entries (devN on PVE >= 8.1, raw lxc lines below), their survival of Proxmox's own config
rewrites, NVSwitch hosts and Fabric Manager, mount options and refusals of missing GPUs.

Split from test_ansible_provision.py so the containers tier's workers run these plays beside
the real containers (tests/README.md: the tiers).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from tests.ansible_fixtures import (
    ANSIBLE_DIR,
    PVE_IDMAP_BASE,
    STANDIN_MAJOR,
    run_playbook,
    write_inventory,
)
from tests.pve_backend import PveHost, golden, needs_root, play_ok


@needs_root
def test_proxmox_backend_devn_entries_survive_proxmox_rewrites(tmp_path: Path) -> None:
    """PVE 8.2: passthrough through devN entries. Golden files tests/golden/pct-commands.txt and
    tests/golden/pve-200.conf. Then the CT config goes through Proxmox's own rewrite (what a
    GUI edit, snapshot or backup lock does): the next run changes nothing and reboots nothing."""
    from tests.pct_lxc_standin import proxmox_rewrite

    pve = PveHost(tmp_path)
    play_ok(pve.run())
    assert pve.commands() == golden("pct-commands.txt", pve).splitlines()
    # The scratch mount's host side belongs to the unprivileged CT's root (PVE maps it to 100000).
    owner = pve.scratch.stat()
    assert (owner.st_uid, owner.st_gid, stat.S_IMODE(owner.st_mode)) == (PVE_IDMAP_BASE, PVE_IDMAP_BASE, 0o1777)
    conf = pve.conf.read_text()
    assert conf == golden("pve-200.conf", pve)
    # CT 200's 64 CPUs are 32 whole cores, 16 on each socket (its GPUs are on both), kept for slurm.conf.
    topology = json.loads((pve.topology_dir / "kpro6-ct200.json").read_text())
    assert (topology["sockets"], topology["cores_per_socket"], topology["threads_per_core"]) == (2, 16, 2)
    assert topology["gpu_cores"] == {**{str(i): "0-15" for i in range(4)}, **{str(i): "16-31" for i in range(4, 8)}}
    raw = [line for line in conf.splitlines() if line.startswith("lxc.")]
    assert raw == ["lxc.cgroup2.cpuset.cpus: 0-15,64-79,128-143,192-207"], "devN entries need no raw device lines"

    pve.conf.write_text("# CT 200: trainer\n" + conf)  # a note added in the GUI
    proxmox_rewrite(pve.conf)
    subprocess.run(["pct", "set", "200", "--lock", "backup"], env={**os.environ, **pve.env}, check=True)
    subprocess.run(["pct", "unlock", "200"], env={**os.environ, **pve.env}, check=True)
    rewritten = pve.conf.read_text()
    assert rewritten.startswith("# CT 200%3A trainer\n")
    assert play_ok(pve.run())["changed"] == 0
    assert pve.commands() == [], "no set, no reboot"
    assert pve.conf.read_text() == rewritten

    # --check --diff after an inventory change shows exactly the device diff, and changes nothing.
    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5])
    proc, recap = pve.run("--check", "--diff")
    assert play_ok((proc, recap))["changed"] == 1 and pve.commands() == []
    assert pve.conf.read_text() == rewritten
    shown = re.findall(r"^\s+- '([+-] [a-z0-9]+: .*)'$", proc.stdout, re.M)
    opts = "gid=0,mode=0666,uid=0"
    assert shown == [f"- dev6: /dev/nvidia6,{opts}", f"- dev7: /dev/nvidia7,{opts}"], proc.stdout[-3000:]
    play_ok(pve.run())
    assert pve.commands() == ["pct set 200 --delete dev6,dev7", "pct reboot 200"]

def test_pct_standin_hot_plugs_a_new_devn_from_pve_9_and_keeps_it_pending_on_8(tmp_path: Path) -> None:
    """pve-container 6.0.4 (PVE 9.0) hot-plugs a new devN into a running CT; PVE 8.x keeps it in
    [pve:pending] until the next start (memory is hot-plugged on both)."""
    from tests.pct_lxc_standin import parse_conf

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")
    (tmp_path / "dev" / "nvidia1").write_text("")
    for version, hot in (("8.4.1", False), ("9.0.3", True)):
        conf_dir = tmp_path / version
        conf_dir.mkdir()
        env = {**os.environ, "PCT_CONF_DIR": str(conf_dir), "PCT_DEV_ROOT": str(tmp_path / "dev"),
               "PCT_PVE_VERSION": version}

        def pct(*args: str, env: dict[str, str] = env) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "tests.pct_lxc_standin", *args], capture_output=True,
                                  text=True, env=env, cwd=ANSIBLE_DIR.parent, timeout=60)

        assert pct("create", "200", "local:vztmpl/x.tar.zst", "--memory", "2048", "--dev0", "/dev/nvidia0").returncode == 0
        assert pct("start", "200").returncode == 0
        assert pct("set", "200", "--memory", "4096", "--dev1", "/dev/nvidia1").returncode == 0
        main = parse_conf((conf_dir / "200.conf").read_text())
        assert main.options["memory"] == "4096", version
        assert ("dev1" in main.options) is hot, version
        assert ("new dev1: /dev/nvidia1" in pct("pending", "200").stdout.splitlines()) is not hot, version
        assert pct("reboot", "200").returncode == 0
        assert parse_conf((conf_dir / "200.conf").read_text()).options["dev1"] == "/dev/nvidia1"

def test_pct_standin_locks_value_checks_and_pending_changes(tmp_path: Path) -> None:
    """The stand-in itself (no Ansible): a locked CT refuses `pct set` and `pct start` as Proxmox
    does; cores/memory below the schema's minimum are refused; on a running CT (PVE 9) memory and
    a new devN apply at once, a devN delete waits in [pve:pending] until the next start."""
    from tests.pct_lxc_standin import parse_conf

    (tmp_path / "dev").mkdir()
    for name in ("nvidia0", "nvidia1"):
        (tmp_path / "dev" / name).write_text("")  # state-only mode checks only that the node exists
    conf = tmp_path / "200.conf"
    env = {**os.environ, "PCT_CONF_DIR": str(tmp_path), "PCT_DEV_ROOT": str(tmp_path / "dev"),
           "PCT_PVE_VERSION": "9.0.3"}

    def pct(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tests.pct_lxc_standin", *args], capture_output=True, text=True,
                              env=env, cwd=ANSIBLE_DIR.parent, timeout=60)

    for bad, message in ((["--cores", "0"], "cores: value must have a minimum value of 1"),
                         (["--memory", "8"], "memory: value must have a minimum value of 16")):
        proc = pct("create", "200", "local:vztmpl/x.tar.zst", *bad)
        assert proc.returncode != 0 and message in proc.stderr and not conf.exists()
    assert pct("create", "200", "local:vztmpl/x.tar.zst", "--cores", "2", "--memory", "2048",
               "--dev0", "/dev/nvidia0").returncode == 0
    assert pct("start", "200").returncode == 0
    assert pct("set", "200", "--memory", "4096", "--dev1", "/dev/nvidia1").returncode == 0  # hot-plugged
    assert pct("set", "200", "--delete", "dev0").returncode == 0  # pending
    main = parse_conf(conf.read_text())
    assert main.options["memory"] == "4096" and main.options["dev1"] == "/dev/nvidia1"
    assert main.options["dev0"] == "/dev/nvidia0" and main.sections == "[pve:pending]\ndelete: dev0\n"
    assert pct("pending", "200").stdout.splitlines() == [
        "cur arch: amd64", "cur cores: 2", "del dev0: /dev/nvidia0", "cur dev1: /dev/nvidia1", "cur memory: 4096",
        "cur ostype: ubuntu", "cur unprivileged: 0"]
    assert "dev0" not in pct("config", "200").stdout and "dev0" in pct("config", "200", "--current").stdout

    conf.write_text(conf.read_text().replace("arch: amd64", "arch: amd64\nlock: backup"))  # vzdump holds it
    for args in (("set", "200", "--cores", "4"), ("reboot", "200")):
        proc = pct(*args)
        assert proc.returncode != 0 and "CT is locked (backup)" in proc.stderr, proc.stderr
    assert "cores: 2\n" in conf.read_text() and "[pve:pending]" in conf.read_text()
    assert pct("unlock", "200").returncode == 0 and pct("reboot", "200").returncode == 0
    after = parse_conf(conf.read_text())
    assert "dev0" not in after.options and after.sections == "" and after.options["dev1"] == "/dev/nvidia1"

@needs_root
def test_proxmox_backend_raw_lines_below_pve_8_1_are_managed_by_key_and_value(tmp_path: Path) -> None:
    """PVE 7.4 has no devN: raw lxc.* lines with exact major:minor, no `optional` mount. Lines an
    older version wrote between comment markers are replaced; after Proxmox's rewrite (markers
    in the description, `lxc.key: value` at the end) the next run changes nothing."""
    from tests.pct_lxc_standin import proxmox_rewrite

    pve = PveHost(tmp_path, pve_version="7.4-3", ct_gpus=[0, 1])
    subprocess.run(["pct", "create", "200", "local:vztmpl/x.tar.zst", "--cores", "64", "--memory", "502784",
                    "--unprivileged", "1"], env={**os.environ, **pve.env}, check=True)
    with pve.conf.open("a") as conf:  # what this role wrote before: markers, a wildcard major, optional mounts
        conf.write("# BEGIN launch managed: gpu passthrough\nlxc.cgroup2.devices.allow = c 195:* rwm\n"
                   f"lxc.mount.entry = {pve.dev}/nvidia5 dev/nvidia5 none bind,optional,create=file\n"
                   "# END launch managed: gpu passthrough\nlxc.apparmor.profile = unconfined\n")
    proxmox_rewrite(pve.conf)
    play_ok(pve.run())
    conf = pve.conf.read_text()
    raw = re.findall(r"^(lxc\.[a-z0-9.]+): (.*)$", conf, re.M)
    nodes = {"nvidia0": 0, "nvidia1": 1, "nvidia-caps/nvidia-cap1": 1, "nvidia-uvm": 254, "nvidiactl": 255}
    assert raw == [("lxc.apparmor.profile", "unconfined")] + [
        pair for name, minor in nodes.items()
        for pair in (("lxc.cgroup2.devices.allow", f"c {STANDIN_MAJOR}:{minor} rwm"),
                     ("lxc.mount.entry", f"{pve.dev}/{name} dev/{name} none bind,create=file 0 0"))] + [
        ("lxc.cgroup2.cpuset.cpus", "0-31,128-159")]  # 32 whole cores of socket 0, its GPUs' socket
    assert "launch managed" not in conf and "optional" not in conf and "*" not in conf
    assert not any(re.match(r"dev\d+:", line) for line in conf.splitlines())

    proxmox_rewrite(pve.conf)
    rewritten = pve.conf.read_text()
    assert play_ok(pve.run())["changed"] == 0 and pve.commands() == []
    assert pve.conf.read_text() == rewritten

    # Raw lines are edited in the file, where Proxmox records nothing pending: the host's marker
    # keeps the reboot refused while jobs run, and the run after draining does it once.
    pve.jobs.write_text("77\n")
    pve.container(ct_gpus=[0])
    proc, _ = pve.run()
    marker = tmp_path / "pending" / "200.restart"
    assert proc.returncode != 0 and "but Slurm runs jobs 77" in proc.stdout and marker.is_file()
    assert f"{pve.dev}/nvidia1" not in pve.conf.read_text() and pve.commands() == []
    pve.jobs.write_text("")
    play_ok(pve.run())
    assert pve.commands() == ["pct reboot 200"] and not marker.exists()

@needs_root
def test_nvswitch_host_needs_fabric_manager_and_keeps_the_switches(tmp_path: Path) -> None:
    """An HGX host (stand-in /dev/nvidia-nvswitch* nodes, major 195): with no Fabric Manager
    running (this machine's real systemctl says so) the run stops before any CT is made, naming
    error 802 and the driver's version; with one running (stand-in `systemctl is-active` and
    `nv-fabricmanager --version` on PATH: no NVSwitch here) the CT gets its GPUs and no switch."""
    pve = PveHost(tmp_path)
    for name, minor in (("nvidia-nvswitch0", 100), ("nvidia-nvswitch1", 101), ("nvidia-nvswitchctl", 102)):
        os.mknod(pve.dev / name, 0o666 | stat.S_IFCHR, os.makedev(STANDIN_MAJOR, minor))
    pve.loaded_driver("550.54.15")
    # No pinned source for Fabric Manager (Debian/PVE packages none): refused, naming the archive.
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and pve.commands() == []
    archive = ("https://developer.download.nvidia.com/compute/nvidia-driver/redist/fabricmanager/linux-x86_64/"
               "fabricmanager-linux-x86_64-550.54.15-archive.tar.xz")
    assert ("kpro6: NVSwitch devices (nvidia-nvswitch0, nvidia-nvswitch1) need Fabric Manager of the driver's exact "
            f"version (550.54.15), installed from NVIDIA's archive {archive}; set gpu_host_fabricmanager_sha256: "
            f'{{"550.54.15": "<sha256>"}} with what this prints: curl -fsSL {archive} | sha256sum') in out, out[-3000:]

    pve.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"][
        "gpu_host_fabricmanager_sha256"] = {"550.54.15": "cd" * 32}
    write_inventory(pve.inventory, pve.data)
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert ("kpro6: the host has NVSwitch devices (nvidia-nvswitch0, nvidia-nvswitch1) but "
            "nvidia-fabricmanager.service is not active") in out, proc.stdout[-3000:]
    assert "error 802" in out and "Install Fabric Manager of the driver's exact version (550.54.15)" in out
    assert pve.commands() == []

    for tool, body in (("systemctl", 'test "$1 $2" = "is-active nvidia-fabricmanager.service" && echo active'),
                       ("nv-fabricmanager", "echo 'Fabric Manager version is : 550.54.15'")):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    play_ok(pve.run())
    conf = pve.conf.read_text()
    assert "/dev/nvidia-nvswitch" not in conf and all(f"/dev/nvidia{i}," in conf for i in range(8))

def _fabricmanager_archive(root: Path, version: str) -> Path:
    """A Fabric Manager archive in NVIDIA's layout (bin, lib with its .so link, include, etc,
    share/nvidia/nvswitch, systemd, sbin), whose daemon prints `version` and whose own
    fm_run_package_installer.sh copies nothing and exits 0 (as older copies of it did)."""
    import tarfile

    top = root / f"fabricmanager-linux-x86_64-{version}-archive"
    files = {"bin/nv-fabricmanager": f"#!/bin/sh\necho 'Fabric Manager version is : {version}'\n",
             "bin/nvswitch-audit": "#!/bin/sh\n", "lib/libnvfm.so.1": "elf", "include/nv_fm_agent.h": "/* h */\n",
             "etc/fabricmanager.cfg": "LOG_LEVEL=4\n", "share/nvidia/nvswitch/dgx2_hgx2_topology": "topology",
             "systemd/nvidia-fabricmanager.service": "[Service]\nExecStart=/usr/bin/nv-fabricmanager\n",
             "sbin/fm_run_package_installer.sh": "#!/bin/sh\nexit 0\n"}
    for rel, text in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
        (top / rel).chmod(0o755 if rel.startswith(("bin/", "sbin/")) else 0o644)
    (top / "lib" / "libnvfm.so").symlink_to("libnvfm.so.1")
    archive = root / "fabricmanager" / "linux-x86_64" / f"{top.name}.tar.xz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(top, arcname=top.name)
    return archive


@needs_root
def test_fabric_manager_is_installed_from_the_archives_own_folders(tmp_path: Path) -> None:
    """Fabric Manager of the driver's version from NVIDIA's archive, served over HTTP with its
    redistrib_<version>.json: the sha256 comes from that file (the inventory pins none), the
    role's own tasks place each folder's files (the archive's installer, which here copies
    nothing and exits 0, is not trusted), `nv-fabricmanager --version` is checked, a second run
    changes nothing and keeps the admin's fabricmanager.cfg; a tampered archive is refused."""
    import hashlib
    import http.server
    import threading

    import yaml

    version = "550.54.15"
    served = tmp_path / "served"
    archive = _fabricmanager_archive(served, version)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    (served / f"redistrib_{version}.json").write_text(json.dumps({"release_date": "2024-02-23", "fabricmanager": {
        "name": "NVIDIA Fabric Manager", "version": version, "linux-x86_64": {
            "relative_path": f"fabricmanager/linux-x86_64/{archive.name}", "sha256": sha}}}))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    root, cache = tmp_path / "root", tmp_path / "cache"
    play = tmp_path / "fm.yml"
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "vars": {
        "gpu_host_driver_version": version, "gpu_host_nvswitch_nodes": ["nvidia-nvswitch0"],
        "gpu_host_fabricmanager_url": f"{base}/fabricmanager/linux-x86_64/fabricmanager-linux-x86_64-{{version}}-archive.tar.xz",
        "gpu_host_fabricmanager_redistrib_url": f"{base}/redistrib_{{version}}.json",
        "gpu_host_fabricmanager_dir": str(cache), "gpu_host_fabricmanager_root": str(root)}, "tasks": [
        {"ansible.builtin.include_role": {"name": "gpu_host", "tasks_from": name}}
        for name in ("fabricmanager_source.yml", "fabricmanager_install.yml")]}]))
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    env = {"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")}
    try:
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert proc.returncode == 0 and recap["localhost"]["failed"] == 0, proc.stdout[-4000:]
        daemon = root / "usr" / "bin" / "nv-fabricmanager"
        assert subprocess.run([str(daemon), "--version"], capture_output=True, text=True).stdout.strip().endswith(version)
        assert os.readlink(root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvfm.so") == "libnvfm.so.1"
        assert (root / "lib" / "systemd" / "system" / "nvidia-fabricmanager.service").is_file()
        assert (root / "usr" / "share" / "nvidia" / "nvswitch" / "dgx2_hgx2_topology").is_file()
        assert (root / "usr" / "include" / "nv_fm_agent.h").is_file()
        cfg = root / "usr" / "share" / "nvidia" / "nvswitch" / "fabricmanager.cfg"
        cfg.write_text("LOG_LEVEL=1\n")  # the admin's change
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] == 0, proc.stdout[-4000:]
        assert cfg.read_text() == "LOG_LEVEL=1\n"

        # The archive on the server no longer matches NVIDIA's sha256: refused before anything is unpacked.
        shutil.rmtree(cache)
        archive.write_bytes(archive.read_bytes() + b"tampered")
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert recap["localhost"]["failed"] == 1 and "checksum" in proc.stdout.lower(), proc.stdout[-3000:]
        assert not (cache / f"fabricmanager-linux-x86_64-{version}-archive").exists()
    finally:
        server.shutdown()

@needs_root
def test_mount_options_a_user_added_to_mp0_are_kept(tmp_path: Path) -> None:
    """mp0 is the role's by its volume and mount point, not its literal string: options a user
    adds (`mountoptions=`, `backup=`) survive the next run with no `pct set` and no reboot; a
    changed mount point is still set."""
    pve = PveHost(tmp_path)
    play_ok(pve.run())
    env = {**os.environ, **pve.env}
    subprocess.run(["pct", "set", "200", "--mp0", f"{pve.scratch},mp=/scratch,mountoptions=noatime,backup=0"],
                   env=env, check=True, capture_output=True)
    # A changed mpN of a running CT is pending until its restart: the user restarted it.
    subprocess.run(["pct", "reboot", "200"], env=env, check=True, capture_output=True)
    before = pve.conf.read_text()
    assert "mountoptions=noatime" in before
    assert play_ok(pve.run())["changed"] == 0
    assert pve.commands() == [] and pve.conf.read_text() == before
    pve.container(ct_scratch_mount="/nvme", node_caches_root="/nvme/cache")
    play_ok(pve.run())
    assert any(c.startswith("pct set 200") and "mp=/nvme" in c for c in pve.commands()), pve.commands()

@needs_root
def test_proxmox_backend_refuses_missing_gpus_and_foreign_majors(tmp_path: Path) -> None:
    pve = PveHost(tmp_path, gpus=6, gpu_host_expected_gpus=0)
    pve.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"]["gpu_host_expected_gpus"] = 0
    write_inventory(pve.inventory, pve.data)
    proc, _ = pve.run()
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "kpro6-ct200: ct_gpus=[0, 1, 2, 3, 4, 5, 6, 7] but the host has no /dev/nvidia6, /dev/nvidia7" in out
    assert not any(c.startswith("pct start") for c in pve.commands())
    # An override past the inventory check (-e): the role still takes only /proc/devices' majors.
    proc, _ = pve.run("-e", '{"lxc_container_nvidia_majors": [1, 195]}')
    assert proc.returncode != 0 and "only those may pass through" in proc.stdout, proc.stdout[-2000:]
    # Memory 0 past the inventory check: refused before `pct create`, never `--memory 0`.
    proc, _ = pve.run("-e", '{"ct_memory_mb": 0, "ct_gpus": [0]}')
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and "ct_memory_mb=0 (>= 16, required: Proxmox would give 512 MB)" in out, out[-2000:]
    assert pve.commands() == []
