"""The CPUs a CT is pinned to (lxc.cgroup2.cpuset.cpus) and the topology Slurm is told.

PVE applies `cores: N` as N logical CPUs picked anew at every start (and moved by pvestatd's
rebalancing): a physical core twice, both sockets mixed, none near the GPUs. Here the CT gets
whole cores (every hardware thread of each), on its GPUs' sockets, the same number from each
socket, so slurm.conf can state Sockets/CoresPerSocket/ThreadsPerCore and gres.conf the cores
next to each GPU (Cores=, in Slurm's numbering of the node's cores: socket by socket).
"""

from __future__ import annotations

from collections import defaultdict

from ansible.errors import AnsibleFilterError


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise AnsibleFilterError(f"{text!r} is not a CPU list (e.g. 0-15,64-79)")
        cpus += range(int(low), int(high or low) + 1)
    return sorted(set(cpus))


def _ranges(values: list[int]) -> str:
    out: list[str] = []
    for v in sorted(values):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        elif out and "-" not in out[-1] and int(out[-1]) == v - 1:
            out[-1] = f"{out[-1]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def _parse_lscpu(text: str) -> dict[int, tuple[int, int, int]]:
    """`lscpu -p=CPU,CORE,SOCKET,NODE` -> {cpu: (socket, core, node)} (node -1 when unknown)."""
    cpus: dict[int, tuple[int, int, int]] = {}
    for line in str(text).splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = (line.split(",") + ["", "", "", ""])[:4]
        if not all(f.isdigit() for f in fields[:3]):
            raise AnsibleFilterError(f"lscpu line {line!r} is not CPU,CORE,SOCKET,NODE")
        cpu, core, socket = (int(f) for f in fields[:3])
        cpus[cpu] = (socket, core, int(fields[3]) if fields[3].isdigit() else -1)
    if not cpus:
        raise AnsibleFilterError("lscpu listed no CPU")
    return cpus


def pinned_cpu_topology(lscpu: str, count: int, gpu_numa: dict | None = None, pinned: str = "",
                        name: str = "the CT", host_gpu_numa: dict | None = None) -> dict:
    """The CT's CPUs and topology: {cpus, sockets, cores_per_socket, threads_per_core, gpu_cores}.

    lscpu: the host's `lscpu -p=CPU,CORE,SOCKET,NODE`; count: ct_cores (logical CPUs); gpu_numa:
    {GPU minor: its NUMA node} of the CT's GPUs; pinned: the inventory's ct_cpuset, used instead
    of a choice; host_gpu_numa: every host GPU's, for gpu_cores (so the kept topology changes
    only with the CPUs, not with which GPUs the CT has).
    """
    host = _parse_lscpu(lscpu)
    cores: dict[tuple[int, int], list[int]] = defaultdict(list)  # (socket, core) -> its CPUs
    for cpu, (socket, core, _node) in sorted(host.items()):
        cores[(socket, core)].append(cpu)
    threads = min(len(c) for c in cores.values())
    count = int(count)
    if pinned:
        chosen = _cpu_list(pinned)
        unknown = [c for c in chosen if c not in host]
        if unknown:
            raise AnsibleFilterError(f"{name}: ct_cpuset={pinned} names CPUs the host does not have ({_ranges(unknown)})")
        partial = [k for k, v in cores.items() if set(v) & set(chosen) and not set(v) <= set(chosen)]
        if partial:
            raise AnsibleFilterError(f"{name}: ct_cpuset={pinned} splits a physical core (CPUs {_ranges(cores[partial[0]])} "
                                     "are one core): give whole cores")
        if len(chosen) != count:
            raise AnsibleFilterError(f"{name}: ct_cpuset={pinned} has {len(chosen)} CPUs but ct_cores={count}")
        picked = sorted(k for k, v in cores.items() if set(v) <= set(chosen))
    else:
        if count % threads:
            raise AnsibleFilterError(f"{name}: ct_cores={count} is not whole cores: the host's cores have {threads} "
                                     f"threads each (use a multiple of {threads})")
        need = count // threads
        node_socket = {node: socket for socket, _core, node in host.values() if node >= 0}
        gpu_sockets: dict[int, int] = defaultdict(int)
        for numa in (gpu_numa or {}).values():
            if int(numa) in node_socket:
                gpu_sockets[node_socket[int(numa)]] += 1
        by_socket: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for key in sorted(cores):
            by_socket[key[0]].append(key)
        # The GPUs' sockets first (most GPUs first), then the others: as few sockets as hold the
        # cores, at least every GPU socket, the same number of cores from each.
        order = sorted(by_socket, key=lambda s: (-gpu_sockets.get(s, 0), s))
        picked = []
        for used in range(max(1, len(gpu_sockets)), len(order) + 1):
            sockets = order[:used]
            if need % used == 0 and all(len(by_socket[s]) >= need // used for s in sockets):
                picked = sorted(k for s in sockets for k in by_socket[s][:need // used])
                break
        if not picked:
            raise AnsibleFilterError(f"{name}: ct_cores={count} cannot be split evenly over the host's sockets "
                                     f"({len(by_socket)} of {min(len(v) for v in by_socket.values())} cores, {threads} "
                                     "threads each); choose another ct_cores or set ct_cpuset")
        chosen = sorted(c for k in picked for c in cores[k])
    per_socket: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for key in picked:
        per_socket[key[0]].append(key)
    sizes = {len(v) for v in per_socket.values()}
    if len(sizes) != 1:
        raise AnsibleFilterError(f"{name}: ct_cpuset={pinned} has different numbers of cores per socket; Slurm needs "
                                 "the same number on each")
    per = sizes.pop()
    # Slurm numbers a node's cores socket by socket: the CT's i-th socket holds cores i*per..
    slot = {socket: i for i, socket in enumerate(sorted(per_socket))}
    node_socket = {node: socket for socket, _core, node in host.values() if node >= 0}
    gpu_cores = {}
    for minor, numa in (host_gpu_numa if host_gpu_numa is not None else gpu_numa or {}).items():
        socket = node_socket.get(int(numa))
        if socket in slot:
            gpu_cores[int(minor)] = f"{slot[socket] * per}-{slot[socket] * per + per - 1}"
    return {"cpus": _ranges(chosen), "sockets": len(per_socket), "cores_per_socket": per,
            "threads_per_core": threads, "gpu_cores": gpu_cores}


class FilterModule:
    def filters(self) -> dict:
        return {"pinned_cpu_topology": pinned_cpu_topology}
