#!/usr/bin/env python3
"""Validate a provisioning inventory before anything is touched.

Prints one line per problem, naming the host and the variable, every problem of the file at once
(as ansible's argument specs report theirs), and exits 2; exits 0 when the inventory is usable.
A host's checks are independent steps (its own variables, the userspace checksum, the venv, its
place among its siblings): each step reports its first problem. Run by `make provision` and by the first play of provision.yml.

    check_inventory.py ansible/inventory/kpro6.yml [--limit kpro6]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import ipaddress
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath

BACKENDS = ("proxmox", "lxc")
NETWORK_FSTYPES = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs"}


class InventoryError(Exception):
    """One problem in the inventory, phrased as `host: what is wrong; what to do` (or several, one a line)."""


class _Problems:
    """Collects the InventoryError of each independent step, so that one problem does not hide the next."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def step(self, check: Callable[..., None], *args: object) -> bool:
        """Run one check; False (its problem noted) when it found one."""
        try:
            check(*args)
        except InventoryError as err:
            self.found.append(str(err))
            return False
        return True

    def raise_any(self) -> None:
        if self.found:
            raise InventoryError("\n".join(dict.fromkeys(self.found)))


def _strict_loader() -> type:
    """A YAML SafeLoader that refuses a key given twice in one mapping (YAML's last-wins would
    silently drop the first value) and reads Ansible's own tags as plain scalars."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise InventoryError(f"line {line}: key {key!r} is given twice (lines {seen[key]} and {line}); keep one")
                seen.setdefault(key, line)  # type: ignore[arg-type]
            return super().construct_mapping(node, deep)

    for tag in ("!vault", "!unsafe"):
        StrictLoader.add_constructor(tag, lambda loader, node: loader.construct_scalar(node))
    return StrictLoader


def read_inventory_yaml(inventory_path: str) -> object:
    """The inventory file as YAML, or an InventoryError naming the line: bytes that are not UTF-8,
    an empty file, a syntax error, a duplicate key."""
    import yaml

    data = Path(inventory_path).read_bytes()
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise InventoryError(f"{inventory_path}: line {line}: not UTF-8 (byte {data[err.start]:#04x}); "
                             "save the file as UTF-8") from None
    try:
        parsed = yaml.load(text, Loader=_strict_loader())  # noqa: S506 -- a SafeLoader subclass
    except InventoryError as err:
        raise InventoryError(f"{inventory_path}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        raise InventoryError(f"{inventory_path}:{where} not valid YAML ({getattr(err, 'problem', err)})") from None
    if parsed is None:
        raise InventoryError(f"{inventory_path}: the file is empty; see ansible/inventory/kpro6.yml for one")
    return parsed


def _vault_secrets(loader: object) -> None:
    """Give Ansible's loader the vault passwords Ansible's own config names (ANSIBLE_VAULT_PASSWORD_FILE,
    ANSIBLE_VAULT_IDENTITY_LIST), so vault-encrypted group_vars (the munge key) can be read."""
    from ansible.cli import CLI

    from ansible import constants as C

    files = [C.DEFAULT_VAULT_PASSWORD_FILE] if C.DEFAULT_VAULT_PASSWORD_FILE else []
    secrets = CLI.setup_vault_secrets(loader, vault_ids=list(C.DEFAULT_VAULT_IDENTITY_LIST or []),
                                      vault_password_files=files, ask_vault_pass=False, auto_prompt=False)
    loader.set_vault_secrets(secrets)  # type: ignore[attr-defined]


def _vault_hint(message: str) -> str:
    if "vault" not in message.lower():
        return message
    return f"{message} (set ANSIBLE_VAULT_PASSWORD_FILE: the check reads every host's variables)"


# Variables that hold secrets: in the inventory only inside ansible-vault (a vaulted file, or `!vault`).
SECRETS = ("slurm_munge_key_b64", "ansible_password", "ansible_become_password")


def _plain_text_origin(value: object) -> str | None:
    """`file:line` of a value read as plain text from a file that is not vault-encrypted; None for
    a vaulted value (or when Ansible does not say where a value came from)."""
    if type(value).__name__ in ("EncryptedString", "AnsibleVaultEncryptedUnicode"):
        return None
    try:
        from ansible._internal._datatag._tags import Origin  # ansible-core >= 2.19

        origin = Origin.get_tag(value)
        path, line = (origin.path, origin.line_num) if origin is not None else (None, None)
    except ImportError:
        path, line, _ = getattr(value, "ansible_pos", (None, None, None))
    if not path or not Path(path).is_file():
        return None
    with open(path, "rb") as f:
        if f.read(14) == b"$ANSIBLE_VAULT":
            return None
    return f"{Path(path).name} line {line}"


def load_hostvars(inventory_path: str) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Groups and each host's raw inventory variables, through Ansible's own inventory loader."""
    read_inventory_yaml(inventory_path)
    # Duplicate keys in group_vars/host_vars files are errors too, not Ansible's last-wins warning.
    os.environ.setdefault("ANSIBLE_DUPLICATE_YAML_DICT_KEY", "error")
    # A file Ansible cannot read as an inventory is an error here, not a warning and an empty inventory.
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_FAILED", "True")
    os.environ.setdefault("ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED", "True")
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    _vault_secrets(loader)
    captured = io.StringIO()  # Ansible's multi-line parse warnings; the first real cause is kept
    try:
        with contextlib.redirect_stderr(captured):
            inventory = InventoryManager(loader=loader, sources=[inventory_path])
    except Exception as err:
        causes = re.findall(r"Failed to parse inventory with 'yaml' plugin: (.*)", captured.getvalue())
        raise InventoryError(f"{inventory_path}: {_vault_hint(causes[0] if causes else str(err).splitlines()[0])}") from None
    if not inventory.hosts:
        raise InventoryError(f"{inventory_path}: no hosts parsed; check the YAML (ansible-inventory -i {inventory_path} --graph)")
    groups = {name: [h.name for h in group.get_hosts()] for name, group in inventory.groups.items()}
    variables = VariableManager(loader=loader, inventory=inventory)
    hostvars = {}
    for host in inventory.hosts.values():
        try:
            raw = variables.get_vars(host=host, include_hostvars=False)
        except Exception as err:  # a group_vars file Ansible cannot read (vaulted without a password)
            raise InventoryError(f"{host}: {_vault_hint(str(err).splitlines()[0])}") from None
        templar = Templar(loader=loader, variables=raw)
        plain = {k: origin for k in SECRETS if raw.get(k) and (origin := _plain_text_origin(raw[k]))}
        if plain:
            name, origin = next(iter(plain.items()))
            raise InventoryError(f"{host}: {name} is a secret in plain text ({origin}); put it in an ansible-vault "
                                 "file (ansible-vault create ansible/inventory/group_vars/gpu_containers/vault.yml)")
        rendered = {}
        for key, value in raw.items():
            if key in ("groups", "hostvars", "vars", "environment") or (
                    key.startswith("ansible_") and key not in ("ansible_host", "ansible_user")):
                continue
            try:
                rendered[key] = templar.template(value)
            except Exception:  # a var that needs facts (e.g. ansible_playbook_python): keep it raw
                rendered[key] = value
        hostvars[host.name] = rendered
    return groups, hostvars


def _int(host: str, name: str, value: object, low: int, high: int | None = None) -> int:
    # int() would take True as 1 and 1.5 as 1: only an integer, or a string of one, is one.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InventoryError(f"{host}: {name}={value!r} is not an integer")
    try:
        number = int(value)
    except ValueError:
        raise InventoryError(f"{host}: {name}={value!r} is not an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InventoryError(f"{host}: {name}={number} is out of range ({bound})")
    return number


def _abs_path(host: str, name: str, value: object) -> PurePosixPath:
    if not isinstance(value, str) or not value.startswith("/"):
        raise InventoryError(f"{host}: {name}={value!r} must be an absolute path")
    if any(c.isspace() for c in value):
        # lxc.mount.entry and Proxmox's mpN are space- and comma-separated: the mount would break.
        raise InventoryError(f"{host}: {name}={value!r} has whitespace, which an lxc.mount.entry cannot carry; "
                             "choose a path without spaces")
    return PurePosixPath(value)


# Every ct_* variable the lxc_container role reads (see its README); another is a typo that the
# role would silently ignore (`ct_gpu:` for `ct_gpus:` gives the container no GPUs).
CT_KEYS = frozenset({
    "ct_vmid", "ct_name", "ct_hostname", "ct_template", "ct_rootfs_storage", "ct_rootfs_size_gb", "ct_unprivileged",
    "ct_net0", "ct_cores", "ct_memory_mb", "ct_gpus", "ct_scratch_mount", "ct_scratch_host_path", "ct_scratch_mode",
    "ct_scratch_allow_rootfs_storage", "ct_scratch_allow_network_fs", "ct_cpuset",
})


def _unknown_ct_keys(host: str, hv: dict) -> None:
    unknown = sorted(k for k in hv if k.startswith("ct_") and k not in CT_KEYS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], CT_KEYS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InventoryError(f"{host}: {unknown[0]} is not a container variable{hint}; the lxc_container role reads "
                             f"only {', '.join(sorted(CT_KEYS))}")


# Variables the roles derive on the host itself; an inventory value could only widen access.
DERIVED = {
    "lxc_container_nvidia_majors": "is read from the host's /proc/devices (only its nvidia* majors pass through)",
    "lxc_container_nvidia_nodes": "is read from the host's /dev (only the container's own GPUs pass through)",
}


# Variables of routes removed because they cannot work; an inventory that still sets one is told why.
REMOVED = {
    "slurm_cgroup_ignore_systemd": "was removed: IgnoreSystemd=yes cannot start slurmd in a CT (Slurm 23.11 creates "
                                   "system.slice/slurmstepd.scope without its parent, and cgroup v2 refuses "
                                   "controllers on a cgroup that holds processes); give the CT systemd as its init",
}


def _no_derived(host: str, hv: dict) -> None:
    for name, why in DERIVED.items():
        if name in hv:
            raise InventoryError(f"{host}: {name} {why}; remove it from the inventory")
    for name, why in REMOVED.items():
        if name in hv:
            raise InventoryError(f"{host}: {name} {why}; remove it from the inventory")


# RFC 1123 host names: dot-separated labels of letters, digits and '-', 1..63 each, no '-' at an end.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _hostname(host: str, name: str, value: object) -> None:
    if not (isinstance(value, str) and len(value) <= 253 and all(_LABEL.match(p) for p in value.split("."))):
        raise InventoryError(f"{host}: {name}={value!r} is not a host name (letters, digits and '-', "
                             "at most 63 between dots)")


# Proxmox's net[n] property string (pct create --net0): key=value pairs, `name` required.
NET_KEYS = {"name", "bridge", "firewall", "gw", "gw6", "hwaddr", "ip", "ip6", "link_down", "mtu", "rate", "tag",
            "trunks", "type"}


def _address(value: str, version: int, interface: bool) -> bool:
    try:
        if interface:
            return "/" in value and ipaddress.ip_interface(value).version == version
        return ipaddress.ip_address(value).version == version
    except ValueError:
        return False


def _net(host: str, name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InventoryError(f"{host}: {name}={value!r} must be a Proxmox net string like name=eth0,bridge=vmbr0,ip=dhcp")
    fields: dict[str, str] = {}
    for part in value.split(","):
        key, eq, val = part.partition("=")
        if not eq or key not in NET_KEYS:
            raise InventoryError(f"{host}: {name}: {part!r} is not one of {', '.join(sorted(NET_KEYS))} =value")
        fields[key] = val
    if not fields.get("name"):
        raise InventoryError(f"{host}: {name}: name= is missing (the interface inside, e.g. name=eth0)")
    for key, val in fields.items():
        if key in ("name", "bridge") and not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", val):
            raise InventoryError(f"{host}: {name}: {key}={val!r} is not an interface name")
    ip = fields.get("ip")
    if ip is not None and ip not in ("dhcp", "manual") and not _address(ip, 4, interface=True):
        raise InventoryError(f"{host}: {name}: ip={ip!r} is not an IPv4 address with a /prefix, dhcp or manual")
    ip6 = fields.get("ip6")
    if ip6 is not None and ip6 not in ("dhcp", "auto", "manual") and not _address(ip6, 6, interface=True):
        raise InventoryError(f"{host}: {name}: ip6={ip6!r} is not an IPv6 address with a /prefix, dhcp, auto or manual")
    for key, version in (("gw", 4), ("gw6", 6)):
        if key in fields and not _address(fields[key], version, interface=False):
            raise InventoryError(f"{host}: {name}: {key}={fields[key]!r} is not an IPv{version} address")


# Mounting scratch on one of these would hide the container's own system files.
SYSTEM_DIRS = {"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/opt", "/proc", "/root", "/run", "/sbin",
               "/sys", "/usr", "/var"}


# The scratch mount's modes the role takes (lxc_container_scratch_mode): 1777 lets every job user write.
SCRATCH_MODES = ("1777", "0777", "0755", "0750", "0700")


def _bool(host: str, name: str, value: object) -> None:
    if not isinstance(value, bool) and str(value).lower() not in {"true", "false", "yes", "no", "0", "1"}:
        raise InventoryError(f"{host}: {name}={value!r} is not a boolean")


def check_container_host(host: str, hv: dict) -> None:
    _no_derived(host, hv)
    backend = hv.get("lxc_container_backend")
    if backend not in BACKENDS:
        raise InventoryError(f"{host}: lxc_container_backend={backend!r}; set it to one of {', '.join(BACKENDS)}")
    _int(host, "gpu_host_expected_gpus", hv.get("gpu_host_expected_gpus", 0), 0, 64)
    scratch = hv.get("gpu_host_scratch_path", "")
    if scratch:
        _abs_path(host, "gpu_host_scratch_path", scratch)
    driver = hv.get("gpu_host_expected_driver_version", "")
    if driver and not re.fullmatch(r"[0-9]+(\.[0-9]+)+", str(driver)):
        raise InventoryError(f"{host}: gpu_host_expected_driver_version={driver!r} is not a driver version "
                             "(cat /sys/module/nvidia/version on the host, e.g. 570.172.08)")
    _unprivileged_root_ids(host, hv)


def _unprivileged(hv: dict, phv: dict) -> bool:
    """ct_unprivileged, else its host's lxc_container_unprivileged, else true (the role's default)."""
    return str(hv.get("ct_unprivileged", phv.get("lxc_container_unprivileged", True))).lower() in ("true", "yes", "1")


def check_container(host: str, hv: dict, hosts: dict[str, dict], container_hosts: list[str]) -> None:
    parent = hv.get("container_host")
    if parent not in container_hosts:
        raise InventoryError(f"{host}: container_host={parent!r} is not a host in group container_hosts")
    phv = hosts[parent]
    _unknown_ct_keys(host, hv)
    if phv.get("lxc_container_backend") == "proxmox":
        if "ct_vmid" not in hv:
            raise InventoryError(f"{host}: ct_vmid is missing; set the Proxmox CT id (100..999999999)")
        _int(host, "ct_vmid", hv["ct_vmid"], 100, 999_999_999)
        if str(hv.get("proxmox_vmid", hv["ct_vmid"])) != str(hv["ct_vmid"]):
            raise InventoryError(f"{host}: proxmox_vmid={hv.get('proxmox_vmid')} differs from ct_vmid={hv['ct_vmid']}")
        for name in ("ct_template", "ct_rootfs_storage"):
            if not hv.get(name):
                raise InventoryError(f"{host}: {name} is missing; see ansible/inventory/kpro6.yml")
    elif not hv.get("ct_template"):
        raise InventoryError(f"{host}: ct_template is missing; set the rootfs .tar.zst the container is created from")
    _no_derived(host, hv)
    for name in ("ct_unprivileged", "ct_scratch_allow_rootfs_storage", "ct_scratch_allow_network_fs"):
        if name in hv:
            _bool(host, name, hv[name])
    # Without ct_hostname the inventory name is the container's host name (and its Slurm NodeName).
    _hostname(host, "ct_hostname" if "ct_hostname" in hv else "ct_hostname (the inventory name)", hv.get("ct_hostname", host))
    if "ct_net0" in hv:
        _net(host, "ct_net0", hv["ct_net0"])
    proxmox = phv.get("lxc_container_backend") == "proxmox"
    # Proxmox refuses cores 0 and memory below 16 MB; an omitted ct_memory_mb would be PVE's 512 MB,
    # too little to train. ct_cores is required: it is the CT's cores and slurm.conf's CPUs= (an
    # omitted one would give the CT all the host's cores and Slurm CPUs=1).
    if proxmox and "ct_memory_mb" not in hv:
        raise InventoryError(f"{host}: ct_memory_mb is missing; Proxmox would give the CT 512 MB (set it, >= 16)")
    if "ct_cores" not in hv:
        raise InventoryError(f"{host}: ct_cores is missing; set the CT's cores (also slurm.conf's CPUs= for it)")
    _int(host, "ct_cores", hv["ct_cores"], 1, 8192)
    memory = _int(host, "ct_memory_mb", hv.get("ct_memory_mb", 0), 0)
    if (proxmox or memory > 0) and memory < 16:
        raise InventoryError(f"{host}: ct_memory_mb={memory} is out of range (16.. as Proxmox allows"
                             f"{'' if proxmox else ', or 0 for no limit'})")
    cpuset = hv.get("ct_cpuset")
    if cpuset is not None and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(cpuset).replace(" ", "")):
        raise InventoryError(f"{host}: ct_cpuset={cpuset!r} is not a CPU list of the host (e.g. \"0-15,128-143\": "
                             "whole cores, the same number on each socket)")
    constrain = hv.get("slurm_constrain_devices", "auto")
    if str(constrain).lower() not in ("auto", "yes", "no", "true", "false"):  # 1, maybe: the role would stop late
        raise InventoryError(f"{host}: slurm_constrain_devices={constrain!r} is not one of auto, yes, no")
    if _unprivileged(hv, phv) and str(hv.get("slurm_constrain_devices", "auto")).lower() in ("yes", "true"):
        raise InventoryError(f"{host}: slurm_constrain_devices=yes cannot work in an unprivileged CT (slurmd's "
                             "cgroup-device eBPF program fails with EPERM there); use auto, or ct_unprivileged: false")
    gpus = hv.get("ct_gpus", [])
    if not isinstance(gpus, list):
        raise InventoryError(f"{host}: ct_gpus={gpus!r} must be a list of GPU indices")
    expected = int(phv.get("gpu_host_expected_gpus", 0) or 0)
    for index in gpus:
        high = expected - 1 if expected else 63
        _int(host, "ct_gpus", index, 0, high)
    if len({int(g) for g in gpus}) != len(gpus):  # by value: 3 and "03" are one GPU
        raise InventoryError(f"{host}: ct_gpus={gpus} lists a GPU twice")
    mode = str(hv.get("ct_scratch_mode", "1777"))
    if mode not in SCRATCH_MODES:
        raise InventoryError(f"{host}: ct_scratch_mode={mode} is not one of {', '.join(SCRATCH_MODES)} "
                             "(quote it: \"1777\")")
    mount = hv.get("ct_scratch_mount", "")
    if hv.get("ct_scratch_host_path") or mount:
        _abs_path(host, "ct_scratch_host_path", hv.get("ct_scratch_host_path"))
        mount = _abs_path(host, "ct_scratch_mount", mount)
        if str(mount).rstrip("/") in SYSTEM_DIRS or str(mount) == "/":
            raise InventoryError(f"{host}: ct_scratch_mount={mount} would cover the container's own {mount}; "
                                 "mount scratch on a directory of its own, such as /scratch")
    cache_root = hv.get("node_caches_root")
    if cache_root:
        cache_path = _abs_path(host, "node_caches_root", cache_root)
        if mount and not (cache_path == mount or mount in cache_path.parents):
            raise InventoryError(
                f"{host}: node_caches_root={cache_root} is not under ct_scratch_mount={mount}; "
                "put the caches on the node-local scratch"
            )
    fstype = hv.get("node_caches_fstype_hint") or phv.get("gpu_host_scratch_fstype")
    if fstype in NETWORK_FSTYPES:
        raise InventoryError(f"{host}: node_caches_root is on {fstype}, a network file system; use node-local NVMe")
    _unprivileged_root_ids(host, hv)


def _unprivileged_root_ids(host: str, hv: dict) -> None:
    for name in ("lxc_container_unprivileged_root_uid", "lxc_container_unprivileged_root_gid"):
        if name in hv:  # 0 would map an unprivileged CT's root (and its scratch) to host root
            _int(host, name, hv[name], 1, 2**32 - 2)


def _pinned_venv(host: str, hv: dict) -> None:
    """A GPU container's venv comes from a lock or a wheelhouse: the package lists are an unpinned
    network install (no fused loss kernel, versions drifting from what was measured), allowed only
    when the inventory says so (python_env_allow_network_install: true)."""
    gpu = str(hv.get("python_env_flavour", "cpu")) == "gpu" or bool(hv.get("ct_gpus"))
    if not gpu or hv.get("python_env_lock_file") or hv.get("python_env_wheelhouse"):
        return
    if "python_env_packages" in hv and not hv["python_env_packages"]:
        return  # nothing installed from the lists
    if _truthy(hv.get("python_env_allow_network_install", False)):
        return
    raise InventoryError(
        f"{host}: python_env_lock_file and python_env_wheelhouse are unset: the GPU container's venv would be an "
        "unpinned network install; set python_env_lock_file to images/trainer/requirements-gpu-cp312.lock "
        "(Ubuntu 24.04; requirements-gpu.lock for Debian 12) or python_env_wheelhouse (make wheelhouse flavour=gpu "
        "os=ubuntu-24.04), or python_env_allow_network_install: true on purpose")


# The userspace installer's defaults (the URLs the role downloads from), read from the role itself.
_USERSPACE_DEFAULTS = Path(__file__).resolve().parents[1] / "roles" / "nvidia_userspace" / "defaults" / "main.yml"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _same_path(a: object, b: object) -> bool:
    """Two path strings that name one directory: /scratch/a and /scratch/a/ (and //scratch/./a)."""
    return isinstance(a, str) and isinstance(b, str) and os.path.normpath(a) == os.path.normpath(b)


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("true", "yes", "1", "on")


def _userspace_checksum(host: str, hv: dict, phv: dict) -> None:
    """A GPU container installs the NVIDIA userspace of the host's exact driver version from
    NVIDIA's .run, which the role runs only against a SHA256 from the inventory: without one the
    play would stop halfway, after the host and the CT were changed. Refuse it here, naming the
    command that prints the checksum (the URL is the role's first, for the host's version)."""
    if not _truthy(hv.get("nvidia_userspace_install", True)):
        return
    if not _truthy(phv.get("gpu_host_require_gpu", True)):
        return  # may be a CPU host (the role is skipped); a driver found there is checked by gpu_host
    import yaml

    urls = hv.get("nvidia_userspace_urls") or yaml.safe_load(_USERSPACE_DEFAULTS.read_text())["nvidia_userspace_urls"]
    sums = hv.get("nvidia_userspace_sha256", {})
    if not isinstance(sums, dict):
        raise InventoryError(f"{host}: nvidia_userspace_sha256={sums!r} must be a mapping "
                             '{"<driver version>": "<sha256 of NVIDIA-Linux-x86_64-<version>.run>"}')
    for version, digest in sums.items():
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)+", str(version)) or not _SHA256.match(str(digest).strip().lower()):
            raise InventoryError(f"{host}: nvidia_userspace_sha256: {version!r}: {digest!r} is not "
                                 '"<driver version>": "<64 hex digits>"')
    expected = str(phv.get("gpu_host_expected_driver_version", "") or "")
    parent = hv.get("container_host")
    if expected:
        if expected in map(str, sums):
            return
        url = str(urls[0]).replace("{version}", expected)
        raise InventoryError(f"{host}: nvidia_userspace_sha256 has no checksum for the host's driver {expected} "
                             f"(the CT installs its userspace); set nvidia_userspace_sha256: {{\"{expected}\": \"<sha256>\"}} "
                             f"with what this prints: curl -fsSL {url} | sha256sum")
    if sums:
        return  # gpu_host checks the loaded driver's version has one, before it changes anything
    target = phv.get("ansible_host") or parent
    user = phv.get("ansible_user")
    url = str(urls[0]).replace("{version}", "$v")
    raise InventoryError(f"{host}: nvidia_userspace_sha256 is not set and the CT installs the userspace of "
                         f"{parent}'s NVIDIA driver; set nvidia_userspace_sha256: {{\"<version>\": \"<sha256>\"}} with "
                         f"what this prints: v=$(ssh {user + '@' if user else ''}{target} cat /sys/module/nvidia/version) "
                         f"&& echo \"$v\" && curl -fsSL \"{url}\" | sha256sum")


# The Slurm release each CT template's distribution ships (its apt sources decide what the slurm
# role installs): matched on the template's file name.
SLURM_RELEASE_BY_TEMPLATE = (
    (re.compile(r"debian-11"), "20.11"), (re.compile(r"debian-12"), "22.05"), (re.compile(r"debian-13"), "24.11"),
    (re.compile(r"ubuntu-22\.04"), "21.08"), (re.compile(r"ubuntu-24\.04"), "23.11"),
)


def _template_slurm_release(hv: dict) -> str | None:
    name = PurePosixPath(str(hv.get("ct_template", "")).split(":")[-1]).name
    return next((release for pattern, release in SLURM_RELEASE_BY_TEMPLATE if pattern.search(name)), None)


def check_slurm_releases(groups: dict[str, list[str]], hosts: dict[str, dict]) -> None:
    """Every node's CT template ships the controller's Slurm release, across the whole inventory:
    `make provision host=H` provisions H's containers only, but their slurmd talks to a controller
    that may live on another host."""
    controller = next(iter(groups.get("slurm_controllers", [])), None)
    mine = _template_slurm_release(hosts[controller]) if controller in hosts else None
    if mine is None:
        return
    for host in sorted(groups.get("gpu_containers", [])):
        theirs = _template_slurm_release(hosts[host])
        if theirs is not None and theirs != mine:
            raise InventoryError(f"{host}: ct_template {hosts[host]['ct_template']} ships Slurm {theirs}, but the "
                                 f"controller {controller}'s ships {mine}: a node of another release than slurmctld "
                                 "is unsupported; give every node a template of the controller's release")


def check(inventory_path: str, limit: str | None = None) -> None:
    if not Path(inventory_path).is_file():
        raise InventoryError(f"{inventory_path}: no such inventory file")
    groups, hosts = load_hostvars(inventory_path)
    container_hosts = groups.get("container_hosts", [])
    if not container_hosts:
        raise InventoryError(f"{inventory_path}: group container_hosts is empty; put hosts under pve_hosts or lxc_hosts")
    wanted = set(hosts) if not limit else {limit, *groups.get(f"{limit}_containers", [])}
    if limit and limit not in hosts:
        raise InventoryError(f"{inventory_path}: host {limit!r} is not in the inventory (hosts: {', '.join(sorted(container_hosts))})")
    problems = _Problems()
    for host in sorted(set(container_hosts) & wanted):
        problems.step(check_container_host, host, hosts[host])
    valid: set[str] = set()  # containers whose own variables passed: the only ones compared with others
    for host in sorted(set(groups.get("gpu_containers", [])) & wanted):
        if problems.step(check_container, host, hosts[host], hosts, container_hosts):
            valid.add(host)
        if hosts[host].get("container_host") not in container_hosts:
            continue  # said by check_container; the steps below need the parent
        problems.step(_userspace_checksum, host, hosts[host], hosts[hosts[host]["container_host"]])
        problems.step(_pinned_venv, host, hosts[host])
        if host in valid:
            problems.step(_siblings, host, hosts, groups, valid)
    problems.step(check_slurm_releases, groups, hosts)  # with --limit too: the controller may be another host's
    problems.raise_any()


def _siblings(host: str, hosts: dict[str, dict], groups: dict[str, list[str]], valid: set[str]) -> None:
    """A container among the other (valid) containers of its host: group, GPUs, scratch path, CT id."""
    parent = hosts[host]["container_host"]
    if host not in groups.get(f"{parent}_containers", []):
        raise InventoryError(f"{host}: container of {parent} but not in group {parent}_containers")
    siblings = sorted(h for h in groups.get(f"{parent}_containers", []) if h < host and h in valid)
    for gpu in hosts[host].get("ct_gpus", []):
        other = next((h for h in siblings if int(gpu) in {int(g) for g in hosts[h].get("ct_gpus") or []}), None)
        if other is not None:
            raise InventoryError(f"{host}: ct_gpus has GPU {gpu}, which {other} has too; "
                                 "a GPU passes through to one container")
    # The scratch host path belongs to the mounting CT's root: a privileged and an unprivileged
    # CT cannot both own it (each run would take it from the other).
    scratch = hosts[host].get("ct_scratch_host_path")
    mine = _unprivileged(hosts[host], hosts[parent])
    other = next((h for h in siblings if scratch and _same_path(hosts[h].get("ct_scratch_host_path"), scratch)
                  and _unprivileged(hosts[h], hosts[parent]) != mine), None)
    if other is not None:
        raise InventoryError(f"{host}: ct_scratch_host_path={scratch} is also {other}'s, and one of the two is "
                             "privileged: its owner is each CT's root; give each a directory of its own")
    if hosts[parent].get("lxc_container_backend") == "proxmox":
        # by value: 200 and "200" are the same CT id
        vmids = [str(hosts[h].get("ct_vmid")).strip() for h in groups.get(f"{parent}_containers", [])]
        if vmids.count(str(hosts[host].get("ct_vmid")).strip()) > 1:
            raise InventoryError(f"{host}: ct_vmid={hosts[host]['ct_vmid']} is used twice on {parent}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inventory")
    parser.add_argument("--limit", help="a container host: check it and its containers only")
    parser.add_argument("--quiet", action="store_true", help="print nothing when the inventory is fine")
    args = parser.parse_args(argv)
    try:
        check(args.inventory, args.limit)
    except InventoryError as err:
        for line in str(err).splitlines():
            print(f"inventory error: {line}", file=sys.stderr)
        return 2
    except Exception as err:  # a YAML or Ansible parse error: still one line
        print(f"inventory error: {args.inventory}: {_vault_hint(str(err).splitlines()[0])}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"inventory ok: {args.inventory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
