#!/usr/bin/env python3
"""Validate a provisioning inventory before anything is touched.

Prints one line naming the host and the variable on the first problem, exits 2; exits 0
when the inventory is usable. Run by `make provision` and by the first play of provision.yml.

    check_inventory.py ansible/inventory/kpro6.yml [--limit kpro6]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path, PurePosixPath

BACKENDS = ("proxmox", "lxc")
NETWORK_FSTYPES = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs"}


class InventoryError(Exception):
    """One problem in the inventory, phrased as `host: what is wrong; what to do`."""


def load_hostvars(inventory_path: str) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Groups and each host's raw inventory variables, through Ansible's own inventory loader."""
    import yaml

    try:
        yaml.safe_load(Path(inventory_path).read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise InventoryError(f"{inventory_path}:{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    # A file Ansible cannot read as an inventory is an error here, not a warning and an empty inventory.
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_FAILED", "True")
    os.environ.setdefault("ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED", "True")
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    captured = io.StringIO()  # Ansible's multi-line parse warnings; the first real cause is kept
    try:
        with contextlib.redirect_stderr(captured):
            inventory = InventoryManager(loader=loader, sources=[inventory_path])
    except Exception as err:
        causes = re.findall(r"Failed to parse inventory with 'yaml' plugin: (.*)", captured.getvalue())
        raise InventoryError(f"{inventory_path}: {causes[0] if causes else str(err).splitlines()[0]}") from None
    if not inventory.hosts:
        raise InventoryError(f"{inventory_path}: no hosts parsed; check the YAML (ansible-inventory -i {inventory_path} --graph)")
    groups = {name: [h.name for h in group.get_hosts()] for name, group in inventory.groups.items()}
    variables = VariableManager(loader=loader, inventory=inventory)
    hostvars = {}
    for host in inventory.hosts.values():
        raw = variables.get_vars(host=host, include_hostvars=False)
        templar = Templar(loader=loader, variables=raw)
        rendered = {}
        for key, value in raw.items():
            if key in ("groups", "hostvars", "vars", "environment") or key.startswith("ansible_"):
                continue
            try:
                rendered[key] = templar.template(value)
            except Exception:  # a var that needs facts (e.g. ansible_playbook_python): keep it raw
                rendered[key] = value
        hostvars[host.name] = rendered
    return groups, hostvars


def _int(host: str, name: str, value: object, low: int, high: int | None = None) -> int:
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InventoryError(f"{host}: {name}={value!r} is not an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InventoryError(f"{host}: {name}={number} is out of range ({bound})")
    return number


def _abs_path(host: str, name: str, value: object) -> PurePosixPath:
    if not isinstance(value, str) or not value.startswith("/"):
        raise InventoryError(f"{host}: {name}={value!r} must be an absolute path")
    return PurePosixPath(value)


# Variables the roles derive on the host itself; an inventory value could only widen access.
DERIVED = {
    "lxc_container_nvidia_majors": "is read from the host's /proc/devices (only its nvidia* majors pass through)",
    "lxc_container_nvidia_nodes": "is read from the host's /dev (only the container's own GPUs pass through)",
}


def _no_derived(host: str, hv: dict) -> None:
    for name, why in DERIVED.items():
        if name in hv:
            raise InventoryError(f"{host}: {name} {why}; remove it from the inventory")


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


def check_container(host: str, hv: dict, hosts: dict[str, dict], container_hosts: list[str]) -> None:
    parent = hv.get("container_host")
    if parent not in container_hosts:
        raise InventoryError(f"{host}: container_host={parent!r} is not a host in group container_hosts")
    phv = hosts[parent]
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
    _int(host, "ct_cores", hv.get("ct_cores", 0), 0)
    _int(host, "ct_memory_mb", hv.get("ct_memory_mb", 0), 0)
    gpus = hv.get("ct_gpus", [])
    if not isinstance(gpus, list):
        raise InventoryError(f"{host}: ct_gpus={gpus!r} must be a list of GPU indices")
    expected = int(phv.get("gpu_host_expected_gpus", 0) or 0)
    for index in gpus:
        high = expected - 1 if expected else 63
        _int(host, "ct_gpus", index, 0, high)
    if len(set(map(int, gpus))) != len(gpus):
        raise InventoryError(f"{host}: ct_gpus={gpus} lists a GPU twice")
    mount = hv.get("ct_scratch_mount", "")
    if hv.get("ct_scratch_host_path") or mount:
        _abs_path(host, "ct_scratch_host_path", hv.get("ct_scratch_host_path"))
        mount = _abs_path(host, "ct_scratch_mount", mount)
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
    for host in sorted(set(container_hosts) & wanted):
        check_container_host(host, hosts[host])
    for host in sorted(set(groups.get("gpu_containers", [])) & wanted):
        check_container(host, hosts[host], hosts, container_hosts)
        parent = hosts[host]["container_host"]
        if host not in groups.get(f"{parent}_containers", []):
            raise InventoryError(f"{host}: container of {parent} but not in group {parent}_containers")
        if hosts[parent].get("lxc_container_backend") == "proxmox":
            vmids = [hosts[h].get("ct_vmid") for h in groups.get(f"{parent}_containers", [])]
            if vmids.count(hosts[host].get("ct_vmid")) > 1:
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
        print(f"inventory error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a YAML or Ansible parse error: still one line
        print(f"inventory error: {args.inventory}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"inventory ok: {args.inventory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
