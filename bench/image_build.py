"""Image build timings, one flavour end to end, in one run (root; real pip, debootstrap, LXC):

    wheelhouse cold (empty dir) | wheelhouse no-op | image build | image no-op | boot + imports + doctor

    sudo python bench/image_build.py --flavour cpu [--jsonl bench/image_build.jsonl] [--keep DIR]

The boot stage unpacks the template into a plain LXC container (`lxc-create -t none`, no
network), starts its systemd, waits for `systemctl is-system-running`, then runs
`import torch, transformers, launch, train` (test flavour: `import launch, train`) and
`launch doctor --no-gdn` inside. The ratios are to the full image build of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def timed(argv: list[str], **kwargs) -> float:
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=ENV, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"image_build: {' '.join(argv[:4])} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}")
    return time.monotonic() - start


def boot(template: Path, work: Path, flavour: str) -> float:
    lxc_path, name = work / "lxc", f"bench-image-{os.getpid()}"
    rootfs = lxc_path / name / "rootfs"
    rootfs.mkdir(parents=True)
    (lxc_path / name / "config").write_text(
        "lxc.include = /usr/share/lxc/config/common.conf\nlxc.arch = x86_64\n"
        f"lxc.uts.name = {name}\nlxc.rootfs.path = dir:{rootfs}\nlxc.net.0.type = empty\n")
    imports = "torch, transformers, launch, train" if flavour != "test" else "launch, train"
    script = ("for i in $(seq 120); do s=$(systemctl is-system-running --wait 2>/dev/null); [ -n \"$s\" ] && break;"
              f" sleep 1; done; echo $s; /opt/launch/venv/bin/python -c 'import {imports}' && "
              ". /etc/profile.d/launch-caches.sh && /opt/launch/venv/bin/launch doctor --no-gdn >/dev/null; echo doctor=$?")
    start = time.monotonic()
    try:
        subprocess.run(["tar", "--zstd", "--numeric-owner", "--xattrs", "--acls", "-xpf", str(template), "-C", str(rootfs)], check=True)
        subprocess.run(["lxc-start", "-P", str(lxc_path), "-n", name], check=True)
        out = subprocess.run(["lxc-attach", "-P", str(lxc_path), "-n", name, "--clear-env", "-v",
                              "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "--", "sh", "-c", script],
                             capture_output=True, text=True, timeout=900).stdout.split()
        if out[:1] not in (["running"], ["degraded"]) or "doctor=0" not in out:
            sys.exit(f"image_build: the container did not come up clean: {' '.join(out)}")
        return time.monotonic() - start
    finally:
        subprocess.run(["lxc-stop", "-P", str(lxc_path), "-n", name, "-k"], capture_output=True)
        subprocess.run(["lxc-destroy", "-P", str(lxc_path), "-n", name], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="cpu", choices=["cpu", "gpu", "test"])
    parser.add_argument("--jsonl", type=Path, help="append one record per stage")
    parser.add_argument("--keep", type=Path, help="work directory to use and keep (default: a temp dir, removed)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("image_build: needs root (debootstrap, chroot, LXC)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-image-"))
    house, out = work / "wheelhouse", work / "images"
    stages: dict[str, float] = {}
    image_args = ["--out", str(out)]
    if args.flavour != "test":
        wheelhouse = [sys.executable, "-m", "images.make_wheelhouse", "--flavour", args.flavour, "--out", str(house)]
        stages["wheelhouse cold"] = timed(wheelhouse)
        stages["wheelhouse no-op"] = timed(wheelhouse)
        image_args += ["--wheelhouse", str(house)]
    build = [sys.executable, "-m", "images.build", "--flavour", args.flavour, *image_args]
    stages["image build"] = timed([*build, "--force"])
    stages["image no-op"] = timed(build)
    manifest = json.loads((out / f"trainer-{args.flavour}" / "manifest.json").read_text())
    stages["boot + imports + doctor"] = boot(out / f"trainer-{args.flavour}" / manifest["template"]["file"], work, args.flavour)

    full = stages["image build"]
    print(f"flavour {args.flavour}: template {manifest['template']['size'] / 2**20:.0f} MiB, "
          f"{len(manifest['apt_packages'])} Debian packages, {len(manifest['venv'].get('packages', {}))} venv distributions")
    print(f"{'stage':<26}{'seconds':>9}{'x build':>9}")
    for stage, seconds in stages.items():
        print(f"{stage:<26}{seconds:>9.1f}{seconds / full:>9.2f}")
    if args.jsonl:
        with args.jsonl.open("a") as f:
            for stage, seconds in stages.items():
                f.write(json.dumps({"flavour": args.flavour, "stage": stage, "seconds": round(seconds, 1),
                                    "machine": platform.node(), "cpus": os.cpu_count(),
                                    "template_mib": round(manifest["template"]["size"] / 2**20)}) + "\n")
    if args.keep is None:
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
