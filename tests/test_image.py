"""`make image`: a real build of the trainer image's test flavour, its no-op re-run, and a real
LXC container booted from the template by the lxc_container role.

Real: debootstrap (the cached base rootfs of tests/ansible_fixtures.py), Ansible's
community.general.chroot connection and the project's roles, apt and gcc inside the chroot,
tar+zstd, Debian's LXC. The test flavour (images/trainer/image.yml) keeps apt offline (the
cached .debs) and its lock offline (--no-index), because nothing inside the build chroot can
reach a package index on the CI machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from images import rootfs as rootfs_mod
from images.build import REPO, load_image
from tests.ansible_fixtures import (
    TEST_BASE,
    cached_rootfs_tarball,
    destroy_container,
    lxc_attach,
    run_playbook,
    write_inventory,
)

IS_ROOT = os.geteuid() == 0
HAS_TOOLS = all(shutil.which(t) for t in ("lxc-create", "lxc-start", "lxc-attach", "debootstrap", "zstd", "chroot"))
needs_root_lxc = pytest.mark.skipif(not (IS_ROOT and HAS_TOOLS), reason="needs root, lxc, debootstrap, zstd")


def make_image(out: Path, *args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess[str], float]:
    """The build entry `make image` runs (mk/image.mk), with this interpreter."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "images.build", "--name", "trainer", "--flavour", "test",
                           "--out", str(out), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, time.monotonic() - start


# --- fast checks (no build) --------------------------------------------------------------------

def test_test_flavour_uses_the_ansible_tests_base_rootfs() -> None:
    image = load_image("trainer", "test")
    assert image.base == TEST_BASE, "the test flavour must hit the rootfs cache the Ansible tests keep"
    assert image.roles == ("toolchain", "node_caches", "python_env")
    assert load_image("trainer", "cpu").lock_file.name == "requirements-cpu.lock"


def test_unknown_image_or_flavour_is_one_line(tmp_path: Path) -> None:
    for args in (["--name", "nope"], ["--flavour", "tpu"]):
        proc = subprocess.run([sys.executable, "-m", "images.build", "--out", str(tmp_path), *args],
                              capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert ("no image named 'nope'" if "nope" in args else "no flavour 'tpu'") in proc.stderr


@pytest.mark.parametrize("target", ["/", "symlink", "bind"])
def test_guard_refuses_the_host_root(tmp_path: Path, target: str) -> None:
    """`/`, a symlink to it, and (as root) a bind mount of it are all refused before anything runs."""
    if target == "/":
        path = Path("/")
    elif target == "symlink":
        path = tmp_path / "root-link"
        path.symlink_to("/")
    else:
        if not IS_ROOT:
            pytest.skip("bind mount needs root")
        path = tmp_path / "root-bind"
        path.mkdir()
        subprocess.run(["mount", "--bind", "/", str(path)], check=True)
    try:
        with pytest.raises(rootfs_mod.LaunchError, match="host's root file system"):
            rootfs_mod.refuse_host_root(path)
        proc = subprocess.run([sys.executable, "-m", "images.build", "--flavour", "test", "--apply-only", str(path)],
                              capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=60)
        assert proc.returncode == 2 and "host's root file system" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    finally:
        if target == "bind":
            subprocess.run(["umount", str(path)], check=True)
    if IS_ROOT:
        with pytest.raises(rootfs_mod.LaunchError):
            rootfs_mod.remove_tree(Path("/"))


@needs_root_lxc
def test_playbook_guard_refuses_the_host_root(tmp_path: Path) -> None:
    """The playbook's own guard, for a run that bypasses images/build.py: an inventory whose
    chroot is `/`. The roles play is skipped (--skip-tags image_roles), so even a broken guard
    could not touch the host."""
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"image": {
        "image_rootfs": "/", "ansible_host": "/", "ansible_connection": "community.general.chroot",
        "ansible_python_interpreter": "/usr/bin/python3", "image_roles": [], "image_packages": []}}}})
    proc, recap = run_playbook(inventory, "--skip-tags", "image_roles",
                               playbook=REPO / "ansible" / "playbooks" / "image.yml", timeout=120)
    assert proc.returncode != 0 and recap["image"]["failed"] == 1, proc.stdout[-2000:]
    assert "is not an image rootfs apart from the host's /" in proc.stdout


@needs_root_lxc
def test_mounts_are_undone_when_the_body_fails(tmp_path: Path) -> None:
    fake_root = tmp_path / "rootfs"
    for sub in ("proc", "sys", "dev", "etc", "usr/sbin"):
        (fake_root / sub).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="boom"), rootfs_mod.chroot_mounts(fake_root):
        assert (fake_root / "proc" / "self").exists() and (fake_root / "dev" / "null").exists()
        assert (fake_root / "usr/sbin/policy-rc.d").exists()
        raise RuntimeError("boom")
    assert rootfs_mod.mounts_under(fake_root) == []
    assert not (fake_root / "usr/sbin/policy-rc.d").exists()
    rootfs_mod.remove_tree(fake_root)
    assert not fake_root.exists()


# --- the real build ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    if not (IS_ROOT and HAS_TOOLS):
        pytest.skip("needs root, lxc, debootstrap, zstd")
    cached_rootfs_tarball()  # the base the Ansible tests share; built once (about a minute) if absent
    out = tmp_path_factory.mktemp("images")
    first, first_s = make_image(out)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr
    second, second_s = make_image(out)
    return {"out": out, "first": first, "first_s": first_s, "second": second, "second_s": second_s,
            "manifest": json.loads((out / "trainer-test" / "manifest.json").read_text())}


@pytest.mark.lxc
@pytest.mark.slow
def test_build_writes_template_and_manifest(built: dict) -> None:
    out, manifest = built["out"] / "trainer-test", built["manifest"]
    template = out / manifest["template"]["file"]
    assert template.is_file() and template.name.startswith(f"trainer-test_{manifest['inputs_hash'][:12]}_")
    assert template.stat().st_size == manifest["template"]["size"]
    assert rootfs_mod.file_sha256(template) == manifest["template"]["sha256"]
    assert not (out / "work").exists(), "the work tree is removed after a good build"
    # Inputs: the image definition, the lock, every role file, the base rootfs identity.
    files = manifest["inputs"]["files"]
    assert "images/trainer/image.yml" in files and "images/trainer/requirements-test.lock" in files
    assert "ansible/roles/toolchain/files/compile_check.sh" in files
    assert "ansible/roles/python_env/tasks/main.yml" in files
    assert manifest["inputs"]["base"]["tarball"] == cached_rootfs_tarball().name
    assert manifest["inputs"]["base"]["sha256"] == rootfs_mod.file_sha256(cached_rootfs_tarball())
    # Versions inside.
    assert manifest["release"] == "bookworm" and "bookworm" in manifest["os"]
    for package in ("gcc", "libc6-dev", "python3-dev", "python3-venv"):
        assert package in manifest["apt_packages"], package
    assert manifest["python"].startswith("3.11.")
    assert manifest["venv"]["path"] == "/opt/launch/venv"
    assert manifest["venv"]["packages"]["setuptools"] == "66.1.1"
    # Progress: stage lines with elapsed times, ansible summarised to one line per task.
    stdout = built["first"].stdout
    for stage in ("base rootfs:", "unpack:", "roles:", "task: toolchain : Install the compiler toolchain",
                  "pack:", "done:"):
        assert stage in stdout, stage
    assert "PLAY RECAP" not in stdout and "ok: [image]" not in stdout
    # Nothing of the build is left mounted.
    assert rootfs_mod.mounts_under(built["out"]) == []


@pytest.mark.lxc
@pytest.mark.slow
def test_second_run_is_a_fast_no_op_and_inputs_change_the_hash(built: dict, tmp_path: Path) -> None:
    second, manifest_path = built["second"], built["out"] / "trainer-test" / "manifest.json"
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout and built["manifest"]["inputs_hash"][:12] in second.stdout
    assert built["second_s"] < 10, f"no-op took {built['second_s']:.1f}s"
    assert json.loads(manifest_path.read_text()) == built["manifest"], "the no-op leaves the manifest alone"

    # A changed input (a copy of the image dir with one more line) changes the hash.
    images_dir = tmp_path / "images"
    shutil.copytree(REPO / "images" / "trainer", images_dir / "trainer")
    with (images_dir / "trainer" / "image.yml").open("a") as f:
        f.write("\n# changed\n")
    from images.build import inputs_digest
    changed, _ = inputs_digest(load_image("trainer", "test", images_dir), cached_rootfs_tarball())
    assert changed != built["manifest"]["inputs_hash"]
    same, _ = inputs_digest(load_image("trainer", "test"), cached_rootfs_tarball())
    assert same == built["manifest"]["inputs_hash"]


@pytest.mark.lxc
@pytest.mark.slow
def test_container_from_the_template_has_gcc_python_dev_and_the_venv(built: dict, tmp_path: Path) -> None:
    """The lxc_container role creates a container from the built image's manifest.json
    (lxc_container_template), with lxc.rootfs.path set and no network."""
    lxc_path = tmp_path / "lxc"
    lxc_path.mkdir()
    name = f"launch-image-{os.getpid()}"
    manifest_path = built["out"] / "trainer-test" / "manifest.json"
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"children": {
        "container_hosts": {"children": {"lxc_hosts": {"hosts": {"localhost": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "lxc_container_backend": "lxc", "lxc_container_lxc_path": str(lxc_path),
            "lxc_container_init_cmd": "/bin/sleep infinity",
            "lxc_container_template": str(manifest_path),
        }}}}},
        "localhost_containers": {"hosts": {name: {"ct_cores": 1, "ct_memory_mb": 1024}}},
    }}})
    playbook = tmp_path / "containers.yml"
    playbook.write_text(
        "- name: Containers\n  hosts: container_hosts\n  gather_facts: false\n"
        "  roles:\n    - role: lxc_container\n"
    )
    try:
        proc, recap = run_playbook(inventory, playbook=playbook, timeout=300,
                                   env={"ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles")})
        assert proc.returncode == 0 and recap["localhost"]["failed"] == 0, proc.stdout[-3000:] + proc.stderr
        config = (lxc_path / name / "config").read_text()
        assert f"lxc.rootfs.path = dir:{lxc_path / name}/rootfs" in config
        assert "lxc.net.0.type = empty" in config
        # The container runs on its own rootfs: a marker only the host has is absent inside.
        marker = Path("/etc") / f"launch-image-host-marker-{os.getpid()}"
        marker.write_text("host\n")
        try:
            probe = lxc_attach(lxc_path, name, f"test ! -e {marker} && echo own-rootfs")
            assert probe.stdout.strip() == "own-rootfs"
        finally:
            marker.unlink()
        inside = lxc_attach(lxc_path, name, (
            "set -e; gcc --version | head -1; dpkg-query -W -f='${Status}\\n' python3-dev;"
            " test -f /usr/include/python3.11/Python.h && echo python-h;"
            " /opt/launch/venv/bin/python -c 'import sys; print(sys.prefix)';"
            " printf '#include <Python.h>\\nint main(void){return 0;}\\n' > /tmp/t.c;"
            " gcc $(python3-config --includes) -c /tmp/t.c -o /tmp/t.o && echo compiled;"
            " . /etc/profile.d/launch-caches.sh; echo $TRITON_CACHE_DIR"
        ))
        lines = inside.stdout.splitlines()
        assert lines[0].startswith("gcc (Debian 12"), inside.stdout
        assert "install ok installed" in lines[1]
        assert "python-h" in lines and "/opt/launch/venv" in lines and "compiled" in lines
        assert lines[-1].startswith("/scratch/cache/")
        rootfs_release = (lxc_path / name / "rootfs" / "etc" / "os-release").read_text()
        assert "bookworm" in rootfs_release
    finally:
        destroy_container(lxc_path, name)
