"""The CPUs the lxc_container role pins a CT to, and the topology the slurm role states.

Real: the role's filter plugin (ansible/roles/lxc_container/filter_plugins/cpu_topology.py)
on `lscpu -p=CPU,CORE,SOCKET,NODE` text of a 2-socket, 64-core, 2-thread host numbered as an
EPYC host numbers its CPUs (the second threads after all first threads).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PLUGIN = Path(__file__).parents[1] / "ansible" / "roles" / "lxc_container" / "filter_plugins" / "cpu_topology.py"


def _plugin():
    spec = importlib.util.spec_from_file_location("cpu_topology", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def epyc_lscpu(sockets: int = 2, cores: int = 64, threads: int = 2) -> str:
    lines = ["# The following is the parsable format", "# CPU,Core,Socket,Node"]
    for t in range(threads):
        for s in range(sockets):
            for c in range(cores):
                lines.append(f"{(t * sockets + s) * cores + c},{s * cores + c},{s},{s}")
    return "\n".join(lines) + "\n"


def test_eight_gpus_on_two_sockets_get_whole_cores_half_from_each_socket() -> None:
    topo = _plugin().pinned_cpu_topology(epyc_lscpu(), 64, {i: 0 if i < 4 else 1 for i in range(8)})
    # 32 physical cores, 16 per socket, both threads of each: never a core twice, never a half core.
    assert topo["cpus"] == "0-15,64-79,128-143,192-207"
    assert (topo["sockets"], topo["cores_per_socket"], topo["threads_per_core"]) == (2, 16, 2)
    assert topo["gpu_cores"] == {**{i: "0-15" for i in range(4)}, **{i: "16-31" for i in range(4, 8)}}


def test_gpus_of_one_socket_keep_the_ct_on_that_socket() -> None:
    topo = _plugin().pinned_cpu_topology(epyc_lscpu(), 16, {6: 1, 7: 1})
    assert topo["cpus"] == "64-71,192-199" and topo["sockets"] == 1 and topo["gpu_cores"] == {6: "0-7", 7: "0-7"}


def test_the_inventorys_cpuset_is_taken_when_it_is_whole_cores() -> None:
    topo = _plugin().pinned_cpu_topology(epyc_lscpu(), 8, {5: 1}, pinned="64-67,192-195")
    assert topo["cpus"] == "64-67,192-195" and topo["cores_per_socket"] == 4 and topo["gpu_cores"] == {5: "0-3"}


@pytest.mark.parametrize(("count", "pinned", "message"), [
    (63, "", "ct_cores=63 is not whole cores: the host's cores have 2 threads each"),
    (8, "64-71", "ct_cpuset=64-71 splits a physical core (CPUs 64,192 are one core)"),
    (8, "0-3,128-131,64-65,192-193", "has 12 CPUs but ct_cores=8"),
    (6, "0-1,128-129,64,192", "has different numbers of cores per socket"),
    (258, "", "ct_cores=258 cannot be split evenly over the host's sockets"),
    (4, "0-1,128-129,999", "names CPUs the host does not have (999)"),
])
def test_a_cpu_choice_that_cannot_be_whole_even_cores_is_refused(count: int, pinned: str, message: str) -> None:
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, ) as err:
        _plugin().pinned_cpu_topology(epyc_lscpu(), count, {}, pinned=pinned, name="kpro6-ct200")
    assert str(err.value).startswith("kpro6-ct200: ") and message in str(err.value), str(err.value)
