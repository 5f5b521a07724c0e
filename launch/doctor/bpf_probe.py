"""Can this process load a BPF_PROG_TYPE_CGROUP_DEVICE program? Slurm's ConstrainDevices=yes
needs one on cgroup v2 (slurmd attaches it to each job's cgroup to allow only its GPUs).

Loading needs CAP_BPF/CAP_SYS_ADMIN in the *initial* user namespace: root of an unprivileged
container is not, and gets EPERM (LXC documents the same limit for its own device cgroup).
The program loaded here is the trivial "allow every device" one (r0 = 1; exit); it is closed
at once and attached nowhere.

Standard library only, so it runs as a plain script too (`python3 bpf_probe.py`: prints
`loaded` or the errno name, exit 0 when it loaded), in any interpreter a namespace can reach.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

# bpf(2) syscall numbers (asm/unistd.h); other architectures are not probed.
SYS_BPF = {"x86_64": 321, "aarch64": 280}
BPF_PROG_LOAD = 5
BPF_PROG_TYPE_CGROUP_DEVICE = 15
ATTR_SIZE = 128  # larger than the fields used; the kernel accepts a zero tail


def _insn(code: int, imm: int) -> bytes:
    return struct.pack("<BBhi", code, 0, 0, imm)  # opcode, dst/src regs (r0), offset, immediate


ALLOW_ALL = _insn(0xB7, 1) + _insn(0x95, 0)  # BPF_ALU64|BPF_MOV|BPF_K r0 = 1; BPF_JMP|BPF_EXIT


def load_cgroup_device_program() -> int | None:
    """0 when the program loaded (and was closed), else the errno (EPERM in a user namespace);
    None where bpf(2) cannot be called (an architecture not in SYS_BPF)."""
    number = SYS_BPF.get(platform.machine())
    if number is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    insns = ctypes.create_string_buffer(ALLOW_ALL, len(ALLOW_ALL))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    # union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license (the rest zero)
    struct.pack_into("<IIQQ", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(ALLOW_ALL) // 8,
                     ctypes.addressof(insns), ctypes.addressof(license_))
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(ctypes.c_long(number), ctypes.c_long(BPF_PROG_LOAD), attr, ctypes.c_uint(ATTR_SIZE))
    if fd < 0:
        return ctypes.get_errno() or errno.EPERM
    os.close(fd)
    return 0


def main() -> int:
    result = load_cgroup_device_program()
    print("unsupported" if result is None else "loaded" if result == 0 else errno.errorcode.get(result, str(result)))
    return 0 if result == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
