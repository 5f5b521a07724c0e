#!/usr/bin/env python3
"""TEST STAND-IN for Proxmox's `pct` and `pveversion`: there is no Proxmox host here.

Written from pct(1), pct.conf(5) and pve-container's config parser/writer
(PVE::LXC::Config parse_pct_config / write_pct_config), so that the `lxc_container` role's
`proxmox` backend meets the behaviour that broke it on real hosts.

Modelled (behaves like Proxmox):
- The CT config `/etc/pve/lxc/<vmid>.conf` is `$PCT_CONF_DIR/<vmid>.conf`. Every write goes
  through Proxmox's parse + write: `#` lines are gathered into the description and written as
  `#`-lines at the top, with `:` (and control/non-ASCII bytes) percent-encoded (`%3A`);
  `key: value` options follow, sorted; raw `lxc.*` lines (read in either `lxc.k = v` or
  `lxc.k: v` form) are written last as `lxc.key: value`, in their order; `[snapshot]` and
  `[pve:pending]` sections are kept after the main section. `proxmox_rewrite(path)` is that
  round trip alone: what a GUI edit, a snapshot or a backup lock does to the file.
- Options are checked against pct.conf(5)'s schema: an unknown key is refused as pct does
  ("property is not defined in schema"), `devN` only from PVE 8.1 on, `--delete k1,k2`.
  Property strings (`devN`, `mpN`) are normalized as Proxmox prints them: the default key
  first, the rest sorted (`/dev/nvidia0,gid=0,mode=0666,uid=0`).
- `pveversion` prints `pve-manager/<$PCT_PVE_VERSION>/... (running kernel: ...)`, default 8.2.4.
- `pct config` prints the options sorted, the description encoded, then the raw lxc entries.
- Config locks: a `lock: <kind>` in the CT config makes `set`, `start`, `reboot`, `shutdown`,
  `stop` and `destroy` refuse as Proxmox's check_lock does ("CT is locked (backup)");
  `pct unlock` clears it (and `pct set --lock` may set one).
- Value checks from the schema: `cores` 1..8192, `memory` >= 16 (MiB), `swap` >= 0, with
  JSONSchema's message ("cores: value must have a minimum value of 1"), on `create` and `set`.
- Pending changes (PVE::LXC::Config update_pct_config / vmconfig_hotplug_pending): on a running
  CT, `cores`, `cpulimit`, `cpuunits`, `memory`, `swap` and NEW `mpN`/`netN` entries are
  hot-plugged (written to the main section at once), NEW `devN` entries too from PVE 9.0 on
  (pve-container 6.0.4; on 8.x they stay pending); a changed existing `devN`/`mpN`/`netN`,
  any `--delete` and every other option that affects the running CT go to the `[pve:pending]`
  section (`delete: k1,k2` for deletes) and are applied at the next `start`/`reboot`. Options
  that do not touch the running CT (`description`, `lock`, `onboot`, `startup`, `protection`,
  `tags`, `hookscript`) are written at once. A stopped CT gets every change at once.
  `pct config` shows the config with the pending changes applied (as Proxmox's default),
  `pct config --current` the running one; `pct pending` prints `cur`/`new`/`del` lines.
- `devN` at start: the host node (`/dev/X` is `$PCT_DEV_ROOT/X`; default `/dev`) must exist as
  a character or block device, or the start fails as Proxmox's does; the container then gets
  exactly that node and a device-cgroup allow for its own major:minor (read/write, or read-only
  with `deny-write=1`), and nothing else of the driver.

Two modes:
- with `$PCT_LXC_PATH`: a real container. `create` unpacks `<storage>:vztmpl/<file>` from
  `$PCT_TEMPLATE_DIR` into `$PCT_LXC_PATH/<vmid>/rootfs`; `start`/`reboot` generate the LXC
  config from the CT config (rootfs, hostname, cores, memory, `mpN` bind mounts, `devN`, raw
  `lxc.*` lines) and run `lxc-start`; `status` is `lxc-info`, `exec` is `lxc-attach`.
- without it: state only (`$PCT_CONF_DIR/<vmid>.state`), for command and config tests. `exec`
  does nothing there, unless `$PCT_STATE_EXEC_PATH` names a directory of stand-in tools (e.g.
  a `squeue` that prints job ids from a file): then the command runs on this machine with that
  directory first on PATH, which is how a state-only test puts jobs "in" the CT.

Not modelled: storage volumes, sizes and template names (a dir rootfs); networking (`net0`
is recorded, the container gets `lxc.net.0.type = empty`); unprivileged CTs in the real-LXC
mode (no idmap; they are refused there, accepted in state-only mode); devN `uid`/`gid`/`mode`
inside the container (the node is a bind mount of the host's, with the host's owner and mode);
AppArmor; hot-plug's effect inside a real-LXC container (a hot-plugged devN or memory limit
reaches the running container only at its next start here; the config is what Proxmox writes);
`pct set --revert`; deletes forced with `!`. On a host whose
devices controller is cgroup v1 (this CI machine) each cgroup2 allow line is mirrored as
`lxc.cgroup.devices.allow`, which is what the cgroup2 line means on a Proxmox host, and the
CT's `lxc.cgroup2.cpuset.cpus` is written as `lxc.cgroup.cpuset.cpus` (the v1 cpuset controller).
`$PCT_INIT_CMD` sets `lxc.init.cmd` (for a rootfs without an init).

Safety: the generated config always sets `lxc.rootfs.path` to the CT's own unpacked rootfs
(without it LXC would run the container on the host's /); raw `lxc.rootfs*` lines are
refused, and `start` refuses a rootfs that is missing or resolves to `/`.

Optional `$PCT_LOG`: each call's argv is appended there (`pct <args>`, one line per call: a
newline inside an argument, such as a `pct exec ... sh -c` script's, is written as `\n`).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote_to_bytes

ATTACH_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PVE_VERSION = "8.2.4"
# pct.conf(5): the plain options, and the indexed ones with their highest index.
PLAIN_KEYS = {
    "arch", "cmode", "console", "cores", "cpulimit", "cpuunits", "debug", "description", "entrypoint",
    "env", "features", "hookscript", "hostname", "lock", "memory", "nameserver", "onboot", "ostype",
    "protection", "rootfs", "searchdomain", "startup", "swap", "tags", "template", "timezone", "tty",
    "unprivileged",
}
INDEXED_KEYS = {"dev": 255, "mp": 255, "net": 31, "unused": 255}
DEV_OPTIONS = ("path", "deny-write", "gid", "mode", "uid")
MP_REQUIRED = ("mp",)


class PctError(Exception):
    pass


# --- the CT config, as pve-container reads and writes it ----------------------------------------

def encode_text(text: str) -> str:
    """PVE::Tools::encode_text: percent-encode all but printable ASCII, and ':' too."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x3A else f"%{b:02X}" for b in text.encode())


def decode_text(text: str) -> str:
    return unquote_to_bytes(text).decode("utf-8", errors="replace")


@dataclass
class CtConf:
    description: str = ""
    options: dict[str, str] = field(default_factory=dict)
    lxc: list[tuple[str, str]] = field(default_factory=list)
    sections: str = ""  # [snapshot] and [pve:pending] sections, verbatim


RAW_LXC = re.compile(r"^(lxc\.[a-z0-9_\-.]+)(?::|\s*=)\s*(.*?)\s*$")
OPTION = re.compile(r"^([a-z][a-z_]*\d*):\s*(\S.*?)\s*$")


def parse_conf(text: str) -> CtConf:
    conf = CtConf()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if re.match(r"^\[[a-z][a-z0-9_\-:]*\]\s*$", line, re.I):
            conf.sections = "\n".join(lines[i:]) + "\n"
            break
        if line.startswith("#"):
            conf.description += decode_text(line[1:]) + "\n"
        elif match := RAW_LXC.match(line):
            conf.lxc.append((match[1], match[2]))
        elif match := re.match(r"^description:\s*(.*\S)\s*$", line):
            conf.description += decode_text(match[1])
        elif match := OPTION.match(line):
            conf.options[match[1]] = match[2]
        else:
            print(f"vm - unable to parse config: {line}", file=sys.stderr)  # Proxmox warns, drops it
    return conf


def render_conf(conf: CtConf) -> str:
    # Perl's split(/\n/) drops trailing empty fields: a description "a\nb\n" is two lines.
    out = [f"#{encode_text(line)}" for line in conf.description.rstrip("\n").split("\n")] if conf.description else []
    out += [f"{key}: {value}" for key, value in sorted(conf.options.items())]
    out += [f"{key}: {value}" for key, value in conf.lxc]
    text = "\n".join(out) + "\n" if out else ""
    return text + ("\n" + conf.sections if conf.sections else "")


def proxmox_rewrite(path: Path) -> None:
    """What any Proxmox write (pct set, a GUI edit, a snapshot, a backup lock) does to the file."""
    write_atomic(path, render_conf(parse_conf(path.read_text())))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- options ------------------------------------------------------------------------------------

def pve_version() -> tuple[int, int, int]:
    text = os.environ.get("PCT_PVE_VERSION", DEFAULT_PVE_VERSION)
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def check_key(key: str) -> None:
    match = re.fullmatch(r"([a-z]+)(\d+)", key)
    known = key in PLAIN_KEYS or (match and match[1] in INDEXED_KEYS and int(match[2]) <= INDEXED_KEYS[match[1]])
    if match and match[1] == "dev" and pve_version() < (8, 1, 0):
        known = False  # devN came with pve-container 5.0.7 (PVE 8.1)
    if not known:
        raise PctError(f"400 Parameter verification failed.\n{key}: property is not defined in schema and "
                       "the schema does not allow additional properties")


def property_string(value: str, default_key: str, allowed: tuple[str, ...] | None) -> str:
    first, *rest = value.split(",")
    props = {}
    if "=" in first and first.split("=", 1)[0] == default_key:
        props[default_key] = first.split("=", 1)[1]
    else:
        props[default_key] = first
    for item in rest:
        key, sep, val = item.partition("=")
        if not sep or (allowed is not None and key not in allowed):
            raise PctError(f"400 Parameter verification failed.\n{key}: invalid format - unknown key '{key}'")
        props[key] = val
    return ",".join([props.pop(default_key)] + [f"{k}={props[k]}" for k in sorted(props)])


def normalize(key: str, value: str) -> str:
    check_key(key)
    if re.fullmatch(r"dev\d+", key):
        value = property_string(value, "path", DEV_OPTIONS)
        path, _, opts = value.partition(",")
        if not path.startswith("/dev/"):
            raise PctError(f"400 Parameter verification failed.\n{key}: invalid format - path must be under /dev")
        mode = dict(o.split("=", 1) for o in opts.split(",") if o).get("mode")
        if mode is not None and not re.fullmatch(r"0?[0-7]{3}", mode):
            raise PctError(f"400 Parameter verification failed.\n{key}: invalid format - mode {mode!r} is not octal")
    elif re.fullmatch(r"mp\d+", key):
        value = property_string(value, "volume", None)
        if "mp=" not in value:
            raise PctError(f"400 Parameter verification failed.\n{key}: invalid format - missing property 'mp'")
    return value


def options(rest: list[str]) -> tuple[dict[str, str], list[str]]:
    """(--key value pairs, keys to --delete)."""
    if len(rest) % 2 or not all(arg.startswith("--") for arg in rest[::2]):
        raise PctError(f"expected --key value pairs, got {rest}")
    pairs = {rest[i][2:]: rest[i + 1] for i in range(0, len(rest), 2)}
    delete = [k for k in pairs.pop("delete", "").split(",") if k]
    for key in delete:
        check_key(key)
    if set(delete) & set(pairs):
        raise PctError(f"400 Parameter verification failed.\n{sorted(set(delete) & set(pairs))[0]}: "
                       "it is not allowed to set and delete the same option")
    check_values(pairs)
    return {key: normalize(key, value) for key, value in pairs.items()}, delete


# --- locks, value checks and pending changes ----------------------------------------------------

# pct.conf(5) bounds (JSONSchema minimum/maximum) of the numeric options the role sets.
VALUE_BOUNDS = {"cores": (1, 8192), "memory": (16, None), "swap": (0, None), "cpulimit": (0, 8192)}
# Applied to a running CT at once (vmconfig_hotplug_pending); new devN/mpN/netN entries too.
HOTPLUG_KEYS = {"cores", "cpulimit", "cpuunits", "memory", "swap"}
# Options written into a running CT's config at once ($LXC_FASTPLUG_OPTIONS of PVE::LXC::Config, PVE 8
# and 9): never pending. The CT's own /etc/hostname follows at its next start.
FASTPLUG_KEYS = {"hostname"}
# Options that do not touch the running CT: written at once, never pending.
DIRECT_KEYS = {"description", "hookscript", "lock", "onboot", "protection", "startup", "tags"}
PENDING_HEADER = "[pve:pending]"


def check_values(pairs: dict[str, str]) -> None:
    for key, value in pairs.items():
        if key not in VALUE_BOUNDS:
            continue
        low, high = VALUE_BOUNDS[key]
        if not re.fullmatch(r"-?\d+", value):
            raise PctError(f"400 Parameter verification failed.\n{key}: type check ('integer') failed - got '{value}'")
        if int(value) < low:
            raise PctError(f"400 Parameter verification failed.\n{key}: value must have a minimum value of {low}")
        if high is not None and int(value) > high:
            raise PctError(f"400 Parameter verification failed.\n{key}: value must have a maximum value of {high}")


def check_lock(conf: CtConf) -> None:
    """PVE::AbstractConfig::check_lock: a locked CT refuses config changes and state changes."""
    if conf.options.get("lock"):
        raise PctError(f"CT is locked ({conf.options['lock']})")


def split_pending(conf: CtConf) -> tuple[dict[str, str], list[str], str]:
    """(pending values, pending deletes, the other sections verbatim) of conf.sections."""
    pending: dict[str, str] = {}
    delete: list[str] = []
    other: list[str] = []
    in_pending = False
    for line in conf.sections.splitlines():
        if re.match(r"^\[.*\]\s*$", line):
            in_pending = line.strip() == PENDING_HEADER
            if in_pending:
                continue
        if not in_pending:
            other.append(line)
        elif match := re.match(r"^delete:\s*(.*\S)\s*$", line):
            delete += [k for k in match[1].split(",") if k]
        elif match := OPTION.match(line):
            pending[match[1]] = match[2]
    rest = "\n".join(other).strip("\n")
    return pending, delete, rest + "\n" if rest else ""


def join_pending(conf: CtConf, pending: dict[str, str], delete: list[str], rest: str) -> None:
    """Write the [pve:pending] section (before the snapshots, as write_pct_config does)."""
    lines = [f"{key}: {value}" for key, value in sorted(pending.items())]
    lines += [f"delete: {','.join(delete)}"] if delete else []
    section = PENDING_HEADER + "\n" + "\n".join(lines) + "\n" if lines else ""
    conf.sections = section + ("\n" if section and rest else "") + rest


# pve-container 6.0.4 (PVE 9.0) hot-plugs a new devN into a running CT; before it (PVE 8.x) a
# new devN stays in [pve:pending] until the next start, like any change to an existing one.
DEVN_HOTPLUG_SINCE = (9, 0, 0)


def hot_pluggable(conf: CtConf, key: str) -> bool:
    if key in HOTPLUG_KEYS or key in DIRECT_KEYS or key in FASTPLUG_KEYS:
        return True
    if key.startswith("dev") and pve_version() < DEVN_HOTPLUG_SINCE:
        return False
    return bool(re.fullmatch(r"(dev|mp|net)\d+", key)) and key not in conf.options  # a new entry


def set_options(conf: CtConf, pairs: dict[str, str], delete: list[str], running: bool) -> None:
    """`pct set`: at once on a stopped CT; on a running one, hot-plug what Proxmox hot-plugs and
    keep the rest in [pve:pending] until the next start."""
    pending, pending_delete, rest = split_pending(conf)
    for key, value in pairs.items():
        pending_delete = [k for k in pending_delete if k != key]
        if running and not hot_pluggable(conf, key):
            pending[key] = value
        else:
            pending.pop(key, None)
            conf.options[key] = value
    for key in delete:
        pending.pop(key, None)
        if running and key not in DIRECT_KEYS:
            pending_delete += [key] if key in conf.options and key not in pending_delete else []
        else:
            conf.options.pop(key, None)
    if "description" in conf.options:
        conf.description = conf.options.pop("description")
    join_pending(conf, pending, pending_delete, rest)


def apply_pending(conf: CtConf) -> CtConf:
    """vmconfig_apply_pending, at start: the pending values and deletes go to the main section."""
    pending, delete, rest = split_pending(conf)
    conf.options.update(pending)
    for key in delete:
        conf.options.pop(key, None)
    conf.sections = rest
    return conf


def print_pending(vmid: str) -> None:
    """`pct pending`: PVE::GuestHelpers::format_pending (cur/new/del, sorted by key)."""
    conf = read_conf(vmid)
    pending, delete, _ = split_pending(conf)
    for key in sorted(set(conf.options) | set(pending)):
        current = conf.options.get(key)
        if current is not None and key in delete:
            print(f"del {key}: {current}")
        elif current is not None:
            print(f"cur {key}: {current}")
            if key in pending:
                print(f"new {key}: {pending[key]}")
        else:
            print(f"new {key}: {pending[key]}")


# --- paths and state ----------------------------------------------------------------------------

def env_path(name: str) -> Path:
    value = os.environ.get(name)
    if not value:
        raise PctError(f"{name} is not set (the pct stand-in's test seam)")
    return Path(value)


def real_lxc() -> bool:
    return bool(os.environ.get("PCT_LXC_PATH"))


def conf_path(vmid: str) -> Path:
    if not re.fullmatch(r"[1-9][0-9]{2,8}", vmid):
        raise PctError(f"invalid vmid {vmid!r}")
    return env_path("PCT_CONF_DIR") / f"{vmid}.conf"


def read_conf(vmid: str) -> CtConf:
    path = conf_path(vmid)
    if not path.exists():
        raise PctError(f"Configuration file 'nodes/localhost/lxc/{vmid}.conf' does not exist")
    return parse_conf(path.read_text())


def host_dev(path: str) -> Path:
    return Path(os.environ.get("PCT_DEV_ROOT", "/dev")) / path.removeprefix("/dev/")


def container_dir(vmid: str) -> Path:
    return env_path("PCT_LXC_PATH") / vmid


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PctError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def state(vmid: str) -> str:
    if not real_lxc():
        state_file = conf_path(vmid).with_suffix(".state")
        return state_file.read_text() if state_file.exists() else "stopped"
    proc = run("lxc-info", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid, "-s", "-H", check=False)
    return "running" if proc.stdout.strip() == "RUNNING" else "stopped"


def cgroup2_only() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


# --- start: the LXC config pve-container would generate -----------------------------------------

def device_lines(key: str, value: str) -> list[str]:
    path, _, opts = value.partition(",")
    props = dict(o.split("=", 1) for o in opts.split(",") if o)
    node = host_dev(path)
    try:
        st = node.stat()
    except FileNotFoundError:
        raise PctError(f"Device {path} does not exist") from None
    if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise PctError(f"{key}: {path} is not a device")
    kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
    access = "r" if props.get("deny-write") == "1" else "rw"
    allow = f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {access}"
    lines = [f"lxc.cgroup2.devices.allow = {allow}"]
    lines += [] if cgroup2_only() else [f"lxc.cgroup.devices.allow = {allow}"]
    return lines + [f"lxc.mount.entry = {node} {path.lstrip('/')} none bind,create=file 0 0"]


def lxc_config(vmid: str) -> str:
    conf = read_conf(vmid)
    opts = conf.options
    rootfs = container_dir(vmid) / "rootfs"
    lines = [
        f"# generated by the pct stand-in (tests/pct_lxc_standin.py) from {conf_path(vmid)}",
        "lxc.include = /usr/share/lxc/config/common.conf",
        "lxc.arch = linux64",
        # Without lxc.rootfs.path LXC runs the container on the host's own root file system.
        f"lxc.rootfs.path = dir:{rootfs}",
        f"lxc.uts.name = {opts.get('hostname', 'CT' + vmid)}",
        "lxc.net.0.type = empty",
    ]
    if os.environ.get("PCT_INIT_CMD"):
        lines.append(f"lxc.init.cmd = {os.environ['PCT_INIT_CMD']}")
    cores, memory = int(opts.get("cores", "0")), int(opts.get("memory", "0"))
    if cgroup2_only():
        lines += [f"lxc.cgroup2.cpu.max = {cores * 100000} 100000"] if cores else []
        lines += [f"lxc.cgroup2.memory.max = {memory}M"] if memory else []
    else:
        lines += ["lxc.cgroup.cpu.cfs_period_us = 100000", f"lxc.cgroup.cpu.cfs_quota_us = {cores * 100000}"] if cores else []
        lines += [f"lxc.cgroup.memory.limit_in_bytes = {memory}M"] if memory else []
    for key in sorted((k for k in opts if re.fullmatch(r"mp\d+", k)), key=lambda k: int(k[2:])):
        source, *props = opts[key].split(",")
        target = dict(p.split("=", 1) for p in props if "=" in p).get("mp", "")
        if not target.startswith("/"):
            raise PctError(f"{key}: {opts[key]} has no absolute mp=")
        lines.append(f"lxc.mount.entry = {source} {target.lstrip('/')} none bind,create=dir 0 0")
    for key in sorted((k for k in opts if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:])):
        lines += device_lines(key, opts[key])
    for key, value in conf.lxc:
        if key.startswith("lxc.rootfs"):
            raise PctError(f"refusing raw {key}: the stand-in owns lxc.rootfs.path")
        if key == "lxc.cgroup2.cpuset.cpus" and not cgroup2_only():
            lines.append(f"lxc.cgroup.cpuset.cpus = {value}")  # the v1 cpuset controller holds it here
            continue
        lines.append(f"{key} = {value}")
        if key == "lxc.cgroup2.devices.allow" and not cgroup2_only():
            lines.append(f"lxc.cgroup.devices.allow = {value}")
    return "\n".join(lines) + "\n"


def checked_rootfs(vmid: str) -> Path:
    rootfs = container_dir(vmid) / "rootfs"
    if not (rootfs / "etc" / "os-release").exists() or rootfs.resolve() == Path("/"):
        raise PctError(f"CT {vmid}: rootfs {rootfs} is missing or is the host's /; refusing to start")
    return rootfs


def start(vmid: str) -> None:
    conf = read_conf(vmid)
    check_lock(conf)
    pending, delete, _ = split_pending(conf)
    if pending or delete:  # vmconfig_apply_pending, before the CT starts
        write_atomic(conf_path(vmid), render_conf(apply_pending(conf)))
    if not real_lxc():
        for key, value in read_conf(vmid).options.items():
            if re.fullmatch(r"dev\d+", key) and not host_dev(value.split(",")[0]).exists():
                raise PctError(f"Device {value.split(',')[0]} does not exist")
        conf_path(vmid).with_suffix(".state").write_text("running")
        return
    checked_rootfs(vmid)
    config = container_dir(vmid) / "config"
    config.write_text(lxc_config(vmid))
    if f"lxc.rootfs.path = dir:{container_dir(vmid) / 'rootfs'}" not in config.read_text().splitlines():
        raise PctError(f"CT {vmid}: generated config lacks its lxc.rootfs.path; refusing to start")
    run("lxc-start", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid)


def stop(vmid: str, kill: bool) -> None:
    if state(vmid) != "running":
        return
    if not real_lxc():
        conf_path(vmid).with_suffix(".state").write_text("stopped")
        return
    run("lxc-stop", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid, *(["-k"] if kill else ["-t", "10"]))


def create(vmid: str, template: str, rest: list[str]) -> None:
    if conf_path(vmid).exists():
        raise PctError(f"CT {vmid} already exists")
    opts, _ = options(rest)
    match = re.fullmatch(r"[\w.-]+:vztmpl/([\w.+-]+)", template)
    if not match:
        raise PctError(f"template {template!r} is not <storage>:vztmpl/<file>")
    conf = CtConf(options={"arch": "amd64", "ostype": "ubuntu", **opts})
    conf.options.setdefault("unprivileged", "0")  # pct create's default; the GUI's is 1
    if real_lxc():
        if conf.options["unprivileged"] != "0":
            raise PctError("the stand-in runs privileged CTs only on real LXC (no idmap); see its docstring")
        tarball = env_path("PCT_TEMPLATE_DIR") / match[1]
        if not tarball.is_file():
            raise PctError(f"template {tarball} not found")
        rootfs = container_dir(vmid) / "rootfs"
        rootfs.mkdir(parents=True, exist_ok=True)
        run("tar", "--zstd", "--numeric-owner", "-xpf", str(tarball), "-C", str(rootfs))
    write_atomic(conf_path(vmid), render_conf(conf))
    if real_lxc():
        create_conf = container_dir(vmid) / "create.conf"
        create_conf.write_text(lxc_config(vmid))
        run("lxc-create", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid, "-t", "none", "-f", str(create_conf))


def print_config(vmid: str, current: bool = False) -> None:
    conf = read_conf(vmid) if current else apply_pending(read_conf(vmid))
    shown = dict(conf.options)
    if conf.description:
        shown["description"] = encode_text(conf.description)
    for key, value in sorted(shown.items()):
        print(f"{key}: {value}")
    for key, value in conf.lxc:
        print(f"{key}: {value}")


def pct(args: list[str]) -> int:
    if len(args) < 2:
        raise PctError("usage: pct VERB VMID [...]")
    verb, vmid, rest = args[0], args[1], args[2:]
    if verb == "create":
        if not rest:
            raise PctError("pct create VMID TEMPLATE [--key value]...")
        create(vmid, rest[0], rest[1:])
    elif verb == "set":
        conf = read_conf(vmid)
        check_lock(conf)
        pairs, delete = options(rest)
        set_options(conf, pairs, delete, running=state(vmid) == "running")
        write_atomic(conf_path(vmid), render_conf(conf))
    elif verb == "unlock":
        conf = read_conf(vmid)
        conf.options.pop("lock", None)
        write_atomic(conf_path(vmid), render_conf(conf))
    elif verb == "config":
        print_config(vmid, current=rest[:2] in (["--current"], ["--current", "1"]))
    elif verb == "pending":
        print_pending(vmid)
    elif verb == "status":
        read_conf(vmid)
        print(f"status: {state(vmid)}")
    elif verb == "start":
        if state(vmid) == "running":
            raise PctError(f"CT {vmid} already running")
        start(vmid)
    elif verb in ("stop", "shutdown"):
        check_lock(read_conf(vmid))
        stop(vmid, kill=verb == "stop")
    elif verb == "reboot":
        check_lock(read_conf(vmid))
        if state(vmid) != "running":
            raise PctError(f"CT {vmid} not running")
        stop(vmid, kill=False)
        start(vmid)
    elif verb == "exec":
        if rest[:1] != ["--"] or len(rest) < 2:
            raise PctError("pct exec VMID -- COMMAND [ARGS]")
        if not real_lxc():
            return state_exec(rest[1:])
        return subprocess.run(["lxc-attach", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid, "--clear-env",
                               "-v", ATTACH_PATH, "--", *rest[1:]]).returncode
    elif verb == "destroy":
        if conf_path(vmid).exists():
            check_lock(read_conf(vmid))
        stop(vmid, kill=True)
        if real_lxc():
            run("lxc-destroy", "-P", str(env_path("PCT_LXC_PATH")), "-n", vmid, check=False)
        conf_path(vmid).unlink(missing_ok=True)
        conf_path(vmid).with_suffix(".state").unlink(missing_ok=True)
    else:
        raise PctError(f"unsupported verb {verb!r} (a test stand-in; see its docstring)")
    return 0


def state_exec(argv: list[str]) -> int:
    """State-only `pct exec`: nothing, or the command on this machine with the stand-in tools of
    $PCT_STATE_EXEC_PATH first on PATH (see the docstring)."""
    tools = os.environ.get("PCT_STATE_EXEC_PATH")
    if not tools:
        return 0
    env = {"PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin", "PCT_CONF_DIR": os.environ.get("PCT_CONF_DIR", "")}
    return subprocess.run(argv, env=env).returncode


def pveversion() -> int:
    version = ".".join(map(str, pve_version()))
    print(f"pve-manager/{version}/0123456789abcdef (running kernel: 6.8.12-1-pve)")
    return 0


def main() -> int:
    args = sys.argv[1:]
    if Path(sys.argv[0]).name == "pveversion" or args[:1] == ["--pveversion"]:
        return pveversion()
    if os.environ.get("PCT_LOG"):
        with open(os.environ["PCT_LOG"], "a") as log:
            log.write("pct " + " ".join(arg.replace("\n", "\\n") for arg in args) + "\n")
    try:
        return pct(args)
    except PctError as exc:
        print(f"{exc}" if str(exc).startswith("400 ") else f"pct (test stand-in): {exc}", file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main())
