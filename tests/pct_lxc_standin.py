#!/usr/bin/env python3
"""TEST STAND-IN for Proxmox's `pct`: there is no Proxmox host here. It maps pct verbs onto
Debian's plain LXC (lxc-create, lxc-start, lxc-info, lxc-attach, ...) so that the
`lxc_container` role's `proxmox` backend can be run end to end against a real container.

What it emulates, and how:
- `/etc/pve/lxc/<vmid>.conf` is `$PCT_CONF_DIR/<vmid>.conf` (a test seam: the role's
  `lxc_container_pve_conf_dir` points at the same directory). `create` writes the keys pct
  would write; `set` updates them; the role appends its raw `lxc.*` GPU block there itself.
- Like pve-container, `start` (and `reboot`) regenerates the LXC config
  `$PCT_LXC_PATH/<vmid>/config` from that CT config: rootfs, hostname, cores, memory, `mp0`, and
  every raw `lxc.*` line verbatim. The container's name in LXC is its vmid.
- `create`'s template `<storage>:vztmpl/<file>` is `$PCT_TEMPLATE_DIR/<file>`, unpacked into
  `$PCT_LXC_PATH/<vmid>/rootfs` (Proxmox would make a volume on `<storage>`; here it is a dir).
- `status` -> `lxc-info`, `exec <vmid> -- cmd` -> `lxc-attach --clear-env`, `config` prints the
  CT config's main section, `stop`/`shutdown`/`destroy` for cleanup.

Not emulated: option validation, storage volumes and sizes, networking (`net0` is recorded;
the container gets `lxc.net.0.type = empty`), unprivileged CTs (refused), snapshots, AppArmor
profiles. `$PCT_INIT_CMD` sets `lxc.init.cmd` (the minimal test rootfs has no systemd).
Proxmox 7+ hosts are pure cgroup2; on a host whose devices controller is cgroup v1 (this CI
machine), each raw `lxc.cgroup2.devices.allow` line is mirrored as `lxc.cgroup.devices.allow`,
which is what the cgroup2 line means on a Proxmox host.

Safety: the generated config always sets `lxc.rootfs.path` to the CT's own unpacked rootfs
(without it LXC would run the container on the host's /); raw `lxc.rootfs*` lines are refused,
and `start` refuses a rootfs that is missing or resolves to `/`.

Optional `$PCT_LOG`: each call's argv is appended there (`pct <args>`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ATTACH_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CREATE_KEYS = ("cores", "features", "hostname", "memory", "net0", "onboot", "rootfs")


class PctError(Exception):
    pass


def env_path(name: str) -> Path:
    value = os.environ.get(name)
    if not value:
        raise PctError(f"{name} is not set (the pct stand-in's test seam)")
    return Path(value)


def lxc_path() -> Path:
    return env_path("PCT_LXC_PATH")


def conf_path(vmid: str) -> Path:
    if not re.fullmatch(r"[1-9][0-9]{2,8}", vmid):
        raise PctError(f"invalid vmid {vmid!r}")
    return env_path("PCT_CONF_DIR") / f"{vmid}.conf"


def options(rest: list[str]) -> dict[str, str]:
    if len(rest) % 2 or not all(arg.startswith("--") for arg in rest[::2]):
        raise PctError(f"expected --key value pairs, got {rest}")
    return {rest[i][2:]: rest[i + 1] for i in range(0, len(rest), 2)}


def read_conf(vmid: str) -> tuple[dict[str, str], list[str], str]:
    """(key: value pairs, raw lxc.* lines, snapshot sections) of a CT config."""
    path = conf_path(vmid)
    if not path.exists():
        raise PctError(f"Configuration file 'nodes/localhost/lxc/{vmid}.conf' does not exist")
    text = path.read_text()
    main, sep, snapshots = text.partition("\n[")
    keys: dict[str, str] = {}
    raw: list[str] = []
    for line in main.splitlines():
        if line.startswith("lxc."):
            raw.append(line)
        elif ": " in line and not line.startswith("#"):
            key, value = line.split(": ", 1)
            keys[key] = value
    return keys, raw, (sep + snapshots if sep else "")


def write_conf(vmid: str, keys: dict[str, str], raw_and_comments: list[str], tail: str = "") -> None:
    path = conf_path(vmid)
    body = "".join(f"{k}: {v}\n" for k, v in sorted(keys.items())) + "".join(f"{line}\n" for line in raw_and_comments)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body + tail.lstrip("\n"))
    os.replace(tmp, path)


def container_dir(vmid: str) -> Path:
    return lxc_path() / vmid


def lxc(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PctError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def state(vmid: str) -> str:
    proc = lxc("lxc-info", "-P", str(lxc_path()), "-n", vmid, "-s", "-H", check=False)
    return "running" if proc.stdout.strip() == "RUNNING" else "stopped"


def cgroup2_only() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


def lxc_config(vmid: str) -> str:
    """The LXC config pve-container would generate from the CT config (the parts emulated)."""
    keys, raw, _ = read_conf(vmid)
    for line in raw:
        if line.split("=", 1)[0].strip().startswith("lxc.rootfs"):
            raise PctError(f"refusing raw {line!r}: the stand-in owns lxc.rootfs.path")
    rootfs = container_dir(vmid) / "rootfs"
    lines = [
        f"# generated by the pct stand-in (tests/pct_lxc_standin.py) from {conf_path(vmid)}",
        "lxc.include = /usr/share/lxc/config/common.conf",
        "lxc.arch = linux64",
        # Without lxc.rootfs.path LXC runs the container on the host's own root file system.
        f"lxc.rootfs.path = dir:{rootfs}",
        f"lxc.uts.name = {keys.get('hostname', 'CT' + vmid)}",
        "lxc.net.0.type = empty",
    ]
    if os.environ.get("PCT_INIT_CMD"):
        lines.append(f"lxc.init.cmd = {os.environ['PCT_INIT_CMD']}")
    cores, memory = int(keys.get("cores", "0")), int(keys.get("memory", "0"))
    if cgroup2_only():
        lines += [f"lxc.cgroup2.cpu.max = {cores * 100000} 100000"] if cores else []
        lines += [f"lxc.cgroup2.memory.max = {memory}M"] if memory else []
    else:
        lines += ["lxc.cgroup.cpu.cfs_period_us = 100000", f"lxc.cgroup.cpu.cfs_quota_us = {cores * 100000}"] if cores else []
        lines += [f"lxc.cgroup.memory.limit_in_bytes = {memory}M"] if memory else []
    for key in sorted(k for k in keys if re.fullmatch(r"mp[0-9]+", k)):
        source, *props = keys[key].split(",")
        target = dict(p.split("=", 1) for p in props if "=" in p).get("mp", "")
        if not target.startswith("/"):
            raise PctError(f"{key}: {keys[key]} has no absolute mp=")
        lines.append(f"lxc.mount.entry = {source} {target.lstrip('/')} none bind,create=dir 0 0")
    for line in raw:
        lines.append(line)
        key, _, value = line.partition("=")
        if key.strip() == "lxc.cgroup2.devices.allow" and not cgroup2_only():
            lines.append(f"lxc.cgroup.devices.allow = {value.strip()}")
    return "\n".join(lines) + "\n"


def checked_rootfs(vmid: str) -> Path:
    rootfs = container_dir(vmid) / "rootfs"
    if not (rootfs / "etc" / "os-release").exists() or rootfs.resolve() == Path("/"):
        raise PctError(f"CT {vmid}: rootfs {rootfs} is missing or is the host's /; refusing to start")
    return rootfs


def start(vmid: str) -> None:
    checked_rootfs(vmid)
    config = container_dir(vmid) / "config"
    config.write_text(lxc_config(vmid))
    if f"lxc.rootfs.path = dir:{container_dir(vmid) / 'rootfs'}" not in config.read_text().splitlines():
        raise PctError(f"CT {vmid}: generated config lacks its lxc.rootfs.path; refusing to start")
    lxc("lxc-start", "-P", str(lxc_path()), "-n", vmid)


def stop(vmid: str, kill: bool) -> None:
    if state(vmid) == "running":
        lxc("lxc-stop", "-P", str(lxc_path()), "-n", vmid, *(["-k"] if kill else ["-t", "10"]))


def create(vmid: str, template: str, rest: list[str]) -> None:
    if conf_path(vmid).exists():
        raise PctError(f"CT {vmid} already exists")
    opts = options(rest)
    if opts.get("unprivileged", "1") != "0":
        raise PctError("the stand-in makes privileged CTs only (--unprivileged 0)")
    match = re.fullmatch(r"[\w.-]+:vztmpl/([\w.+-]+)", template)
    if not match:
        raise PctError(f"template {template!r} is not <storage>:vztmpl/<file>")
    tarball = env_path("PCT_TEMPLATE_DIR") / match.group(1)
    if not tarball.is_file():
        raise PctError(f"template {tarball} not found")
    rootfs = container_dir(vmid) / "rootfs"
    rootfs.mkdir(parents=True, exist_ok=True)
    lxc("tar", "--zstd", "--numeric-owner", "-xpf", str(tarball), "-C", str(rootfs))
    keys = {"arch": "amd64", "ostype": "ubuntu", "unprivileged": "0"}
    keys.update({k: opts[k] for k in CREATE_KEYS if k in opts})
    write_conf(vmid, keys, [])
    config = container_dir(vmid) / "create.conf"
    config.write_text(lxc_config(vmid))
    lxc("lxc-create", "-P", str(lxc_path()), "-n", vmid, "-t", "none", "-f", str(config))


def pct(args: list[str]) -> int:
    if len(args) < 2:
        raise PctError("usage: pct VERB VMID [...]")
    verb, vmid, rest = args[0], args[1], args[2:]
    if verb == "create":
        if not rest:
            raise PctError("pct create VMID TEMPLATE [--key value]...")
        create(vmid, rest[0], rest[1:])
    elif verb == "set":
        keys, raw, tail = read_conf(vmid)
        keys.update(options(rest))
        comments = [line for line in conf_path(vmid).read_text().partition("\n[")[0].splitlines()
                    if line.startswith(("lxc.", "#"))]
        write_conf(vmid, keys, comments, tail)
    elif verb == "config":
        print(conf_path(vmid).read_text().partition("\n[")[0].rstrip("\n"))
    elif verb == "status":
        read_conf(vmid)
        print(f"status: {state(vmid)}")
    elif verb == "start":
        if state(vmid) == "running":
            raise PctError(f"CT {vmid} already running")
        start(vmid)
    elif verb in ("stop", "shutdown"):
        stop(vmid, kill=verb == "stop")
    elif verb == "reboot":
        stop(vmid, kill=False)
        start(vmid)
    elif verb == "exec":
        if rest[:1] != ["--"] or len(rest) < 2:
            raise PctError("pct exec VMID -- COMMAND [ARGS]")
        return subprocess.run(["lxc-attach", "-P", str(lxc_path()), "-n", vmid, "--clear-env", "-v", ATTACH_PATH,
                               "--", *rest[1:]]).returncode
    elif verb == "destroy":
        stop(vmid, kill=True)
        lxc("lxc-destroy", "-P", str(lxc_path()), "-n", vmid, check=False)
        conf_path(vmid).unlink(missing_ok=True)
    else:
        raise PctError(f"unsupported verb {verb!r} (a test stand-in; see its docstring)")
    return 0


def main() -> int:
    args = sys.argv[1:]
    if os.environ.get("PCT_LOG"):
        with open(os.environ["PCT_LOG"], "a") as log:
            log.write("pct " + " ".join(args) + "\n")
    try:
        return pct(args)
    except PctError as exc:
        print(f"pct (test stand-in): {exc}", file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main())
