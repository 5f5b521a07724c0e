"""Bad inputs: inventory (see tests/badinputs/__init__.py for what a case is).

Each case is a copy of a shipped inventory (ansible/inventory/kpro6.yml, a Proxmox host with one
8-GPU container; local.yml, a plain LXC host) with one thing broken, checked by
`ansible/tools/check_inventory.py` in a child as `make provision` runs it. The message names the
host, the variable and the reason, on one line.
"""

from __future__ import annotations

import copy

import yaml

from tests.badinputs import REPO, Case

INVENTORIES = REPO / "ansible" / "inventory"
INV = "{tmp}/inventory.yml"
CT = "kpro6-ct200"


def _load(name: str) -> dict:
    return yaml.safe_load((INVENTORIES / name).read_text())


KPRO6 = _load("kpro6.yml")
# As ansible/README.md's real-host steps complete it: the installer's checksum for the host's driver.
for _ct in KPRO6["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"].values():
    _ct["nvidia_userspace_sha256"] = {"550.54.15": "ab" * 32}
LOCAL = _load("local.yml")


def _containers(data: dict, host: str) -> dict:
    return data["all"]["children"]["gpu_containers"]["children"][f"{host}_containers"]["hosts"]


def _apply(target: dict, changes: dict) -> None:
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def kpro6(ct: dict | None = None, host: dict | None = None, more: dict[str, dict] | None = None,
          group: dict | None = None) -> dict[str, str]:
    """kpro6.yml with container kpro6-ct200's variables changed by `ct` (None removes one), the
    host's by `host`, the containers' group vars by `group`, and further containers `more` (each a
    copy of ct200 with its changes)."""
    data = copy.deepcopy(KPRO6)
    containers = _containers(data, "kpro6")
    _apply(containers[CT], ct or {})
    _apply(data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["vars"], group or {})
    _apply(data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"], host or {})
    for name, changes in (more or {}).items():
        containers[name] = copy.deepcopy(containers[CT])
        _apply(containers[name], changes)
    return {"inventory.yml": yaml.safe_dump(data, sort_keys=False)}


def local(ct: dict | None = None) -> dict[str, str]:
    data = copy.deepcopy(LOCAL)
    _apply(_containers(data, "localhost")["launch-local"], ct or {})
    return {"inventory.yml": yaml.safe_dump(data, sort_keys=False)}


def _case(case_id: str, files: dict[str, str | bytes], expect: str, *args: str) -> Case:
    return Case("inventory", case_id, [*args, INV], expect, files=files, entry="inventory")


MAJORS = r"lxc_container_nvidia_majors is read from the host's /proc/devices"
KPRO6_TEXT = (INVENTORIES / "kpro6.yml").read_text()

CASES = [
    # ---- device majors: only the host's own /proc/devices says which pass through
    _case("majors-star", kpro6({"lxc_container_nvidia_majors": ["*"]}), rf"{CT}: {MAJORS}"),
    _case("majors-one", kpro6({"lxc_container_nvidia_majors": [1]}), rf"{CT}: {MAJORS}"),
    _case("majors-cgroup-rule", kpro6({"lxc_container_nvidia_majors": "a *:* rwm"}), rf"{CT}: {MAJORS}"),
    _case("majors-shell", kpro6({"lxc_container_nvidia_majors": "195; rm -rf /"}), rf"{CT}: {MAJORS}"),
    _case("majors-strings", kpro6({"lxc_container_nvidia_majors": ["195", "a"]}), rf"{CT}: {MAJORS}"),
    # ---- GPU indices
    _case("gpu-out-of-range", kpro6({"ct_gpus": [0, 8]}), rf"{CT}: ct_gpus=8 is out of range \(0\.\.7\)"),
    _case("gpu-negative", kpro6({"ct_gpus": [-1]}), rf"{CT}: ct_gpus=-1 is out of range \(0\.\.7\)"),
    _case("gpu-word", kpro6({"ct_gpus": ["zero"]}), rf"{CT}: ct_gpus='zero' is not an integer"),
    _case("gpu-fraction", kpro6({"ct_gpus": [1.5]}), rf"{CT}: ct_gpus=1\.5 is not an integer"),
    _case("gpu-twice", kpro6({"ct_gpus": [0, 0]}), rf"{CT}: ct_gpus=\[0, 0\] lists a GPU twice"),
    _case("gpu-shared-by-two-containers",
          kpro6({"ct_gpus": [0, 1, 2, 3]}, more={"kpro6-ct201": {"ct_vmid": 201, "proxmox_vmid": 201,
                                                                   "ct_hostname": "trainer201", "ct_gpus": [3, 4]}}),
          r"kpro6-ct201: ct_gpus has GPU 3, which kpro6-ct200 has too; a GPU passes through to one container"),
    # ---- container ids
    _case("vmid-twice", kpro6(more={"kpro6-ct201": {"ct_hostname": "trainer201", "ct_gpus": []}}),
          r"kpro6-ct20[01]: ct_vmid=200 is used twice on kpro6"),
    _case("vmid-below-proxmox-range", kpro6({"ct_vmid": 99, "proxmox_vmid": 99}),
          rf"{CT}: ct_vmid=99 is out of range \(100\.\.999999999\)"),
    _case("vmid-word", kpro6({"ct_vmid": "two hundred", "proxmox_vmid": None}),
          rf"{CT}: ct_vmid='two hundred' is not an integer"),
    _case("vmid-twice-int-and-string", kpro6(more={"kpro6-ct201": {"ct_vmid": "200", "proxmox_vmid": "200",
                                                                    "ct_hostname": "trainer201", "ct_gpus": []}}),
          r"kpro6-ct20[01]: ct_vmid='?200'? is used twice on kpro6"),
    # ---- a typo in a variable name would be ignored by the role
    _case("ct-key-typo", kpro6({"ct_gpu": [0, 1]}), rf"{CT}: ct_gpu is not a container variable \(did you mean ct_gpus\?\)"),
    _case("ct-key-unknown", kpro6({"ct_swap_mb": 512}), rf"{CT}: ct_swap_mb is not a container variable; the lxc_container"),
    # ---- names and the network
    _case("hostname-space", kpro6({"ct_hostname": "trainer 200"}),
          rf"{CT}: ct_hostname='trainer 200' is not a host name \(letters, digits and '-'"),
    _case("hostname-shell", kpro6({"ct_hostname": "t200;reboot"}), rf"{CT}: ct_hostname='t200;reboot' is not a host name"),
    _case("hostname-too-long", kpro6({"ct_hostname": "t" * 64}), rf"{CT}: ct_hostname='t{{64}}' is not a host name"),
    _case("net-no-name", kpro6({"ct_net0": "bridge=vmbr0,ip=dhcp"}), rf"{CT}: ct_net0: name= is missing"),
    _case("net-ip-garbage", kpro6({"ct_net0": "name=eth0,bridge=vmbr0,ip=300.1.2.3/24"}),
          rf"{CT}: ct_net0: ip='300\.1\.2\.3/24' is not an IPv4 address with a /prefix, dhcp or manual"),
    _case("net-ip-no-prefix", kpro6({"ct_net0": "name=eth0,bridge=vmbr0,ip=10.0.0.5"}),
          rf"{CT}: ct_net0: ip='10\.0\.0\.5' is not an IPv4 address with a /prefix"),
    _case("net-gateway-garbage", kpro6({"ct_net0": "name=eth0,bridge=vmbr0,ip=10.0.0.5/24,gw=10.0.0"}),
          rf"{CT}: ct_net0: gw='10\.0\.0' is not an IPv4 address"),
    # ---- sizes
    _case("memory-negative", kpro6({"ct_memory_mb": -1}), rf"{CT}: ct_memory_mb=-1 is out of range"),
    _case("memory-below-proxmox-minimum", kpro6({"ct_memory_mb": 8}),
          rf"{CT}: ct_memory_mb=8 is out of range \(16\.\. as Proxmox allows\)"),
    _case("memory-zero-on-proxmox", kpro6({"ct_memory_mb": 0}), rf"{CT}: ct_memory_mb=0 is out of range \(16\.\."),
    _case("memory-missing-on-proxmox", kpro6({"ct_memory_mb": None}),
          rf"{CT}: ct_memory_mb is missing; Proxmox would give the CT 512 MB"),
    _case("cores-negative", kpro6({"ct_cores": -4}), rf"{CT}: ct_cores=-4 is out of range"),
    _case("cores-zero-on-proxmox", kpro6({"ct_cores": 0}), rf"{CT}: ct_cores=0 is out of range \(1\.\.8192\)"),
    # ---- unprivileged CT
    _case("constrain-devices-in-unprivileged-ct", kpro6({"slurm_constrain_devices": True}),
          rf"{CT}: slurm_constrain_devices=yes cannot work in an unprivileged CT"),
    _case("scratch-shared-by-privileged-and-unprivileged", kpro6(more={"kpro6-ct201": {
              "ct_vmid": 201, "proxmox_vmid": 201, "ct_hostname": "trainer201", "ct_gpus": [], "ct_unprivileged": False}}),
          r"kpro6-ct201: ct_scratch_host_path=/mnt/nvme-scratch/ct200 is also kpro6-ct200's, and one of the two is privileged"),
    # ---- scratch
    _case("scratch-on-network-fs", kpro6(host={"gpu_host_scratch_fstype": "nfs4"}),
          rf"{CT}: node_caches_root is on nfs4, a network file system"),
    _case("scratch-mounted-over-root", kpro6({"ct_scratch_mount": "/", "node_caches_root": "/cache"}),
          rf"{CT}: ct_scratch_mount=/ would cover the container's own /"),
    _case("scratch-mount-space", kpro6({"ct_scratch_mount": "/scratch dir"}),
          rf"{CT}: ct_scratch_mount='/scratch dir' has whitespace, which an lxc.mount.entry cannot carry"),
    _case("scratch-host-path-space", kpro6({"ct_scratch_host_path": "/nvme/ct 200"}),
          rf"{CT}: ct_scratch_host_path='/nvme/ct 200' has whitespace"),
    _case("scratch-host-path-tab", kpro6({"ct_scratch_host_path": "/nvme/ct\t200"}),
          rf"{CT}: ct_scratch_host_path='/nvme/ct\\t200' has whitespace"),
    _case("host-scratch-path-space", kpro6(host={"gpu_host_scratch_path": "/nvme/my scratch"}),
          r"kpro6: gpu_host_scratch_path='/nvme/my scratch' has whitespace"),
    # ---- backends and required keys
    _case("backend-unknown", kpro6(host={"lxc_container_backend": "docker"}),
          r"kpro6: lxc_container_backend='docker'; set it to one of proxmox, lxc"),
    _case("template-missing", kpro6({"ct_template": None}), rf"{CT}: ct_template is missing"),
    _case("container-host-unknown", kpro6({"container_host": "kpro7"}),
          rf"{CT}: container_host='kpro7' is not a host in group container_hosts"),
    # ---- the NVIDIA userspace installer's checksum (the play would stop halfway without it)
    _case("userspace-sha256-missing", kpro6({"nvidia_userspace_sha256": None}),
          rf"{CT}: nvidia_userspace_sha256 is not set .* curl -fsSL \"https://us\.download\.nvidia\.com/tesla/\$v/"
          r"NVIDIA-Linux-x86_64-\$v\.run\" \| sha256sum$"),
    _case("userspace-sha256-not-hex", kpro6({"nvidia_userspace_sha256": {"550.54.15": "abc"}}),
          rf"{CT}: nvidia_userspace_sha256: '550\.54\.15': 'abc' is not"),
    _case("userspace-sha256-other-driver", kpro6(host={"gpu_host_expected_driver_version": "570.172.08"}),
          rf"{CT}: nvidia_userspace_sha256 has no checksum for the host's driver 570\.172\.08 .* curl -fsSL "
          r"https://us\.download\.nvidia\.com/tesla/570\.172\.08/NVIDIA-Linux-x86_64-570\.172\.08\.run \| sha256sum$"),
    _case("driver-version-not-one", kpro6(host={"gpu_host_expected_driver_version": "latest"}),
          r"kpro6: gpu_host_expected_driver_version='latest' is not a driver version"),
    # ---- the GPU container's venv: pinned (a lock or a wheelhouse) unless said otherwise on purpose
    _case("gpu-venv-unpinned", kpro6(group={"python_env_lock_file": None}),
          rf"{CT}: python_env_lock_file and python_env_wheelhouse are unset: the GPU container's venv would be an "
          r"unpinned network install; set python_env_lock_file to images/trainer/requirements-gpu-cp312\.lock .*"
          r"or python_env_allow_network_install: true on purpose$"),
    _case("gpu-venv-unpinned-empty-lock", kpro6({"python_env_lock_file": ""}),
          rf"{CT}: python_env_lock_file and python_env_wheelhouse are unset"),
    # ---- secrets in plain text
    _case("munge-key-in-plain-text", kpro6({"slurm_munge_key_b64": "c2VjcmV0LWtleQ=="}),
          rf"{CT}: slurm_munge_key_b64 is a secret in plain text \(inventory\.yml line \d+\); put it in an ansible-vault file"),
    # ---- the file itself
    _case("yaml-syntax-error", {"inventory.yml": KPRO6_TEXT.replace("ct_cores: 64", "ct_cores: [64")},
          r"inventory\.yml: line \d+: not valid YAML"),
    _case("not-utf8", {"inventory.yml": KPRO6_TEXT.encode().replace(b"trainer200", b"trainer\xff200")},
          rf"inventory\.yml: line {KPRO6_TEXT[:KPRO6_TEXT.index('trainer200')].count(chr(10)) + 1}: not UTF-8 "
          r"\(byte 0xff\); save the file as UTF-8"),
    _case("duplicate-key", {"inventory.yml": KPRO6_TEXT.replace("              ct_cores: 64\n",
                                                                "              ct_cores: 64\n              ct_cores: 2\n")},
          r"inventory\.yml: line \d+: key 'ct_cores' is given twice \(lines \d+ and \d+\); keep one"),
    _case("duplicate-host", {"inventory.yml": KPRO6_TEXT.replace("        kpro6_containers:\n",
                                                                 "        kpro6_containers:\n          hosts: {}\n")},
          r"inventory\.yml: line \d+: key 'hosts' is given twice \(lines \d+ and \d+\)"),
    _case("empty-file", {"inventory.yml": ""}, r"inventory\.yml: the file is empty"),
    _case("only-comments", {"inventory.yml": "# nothing here\n"}, r"inventory\.yml: the file is empty"),
    _case("no-such-file", {}, r"no such inventory file"),
    # ---- the command line
    _case("limit-unknown-host", kpro6(), r"host 'kpro7' is not in the inventory \(hosts: kpro6\)", "--limit", "kpro7"),
]
