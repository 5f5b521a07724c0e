"""`make image` and `make wheelhouse`: real builds of the trainer image, their reproducibility,
and containers booted from the templates with real LXC.

Real: debootstrap (the cached base rootfs of tests/ansible_fixtures.py), pip (the controller's,
with its own configuration, for the wheelhouse), Ansible's community.general.chroot connection
and the project's roles, apt and gcc inside the chroot, tar+zstd+xz, Debian's LXC running
systemd as the container's init, and `launch doctor` inside the container.

- test flavour (offline apt and lock): built twice, byte-compared; booted with `lxc-create -t local`.
- cpu flavour: wheelhouse from the controller's pip (PyPI, and the local wheel directory that
  holds torch's CPU build), built, booted, `import torch, transformers, launch, train` and the
  doctor's fast checks inside.
- gpu flavour: only with LAUNCH_TEST_GPU_IMAGE=1 (its wheels are several GB; not in CI). On a
  machine without a GPU it checks the imports and the doctor's CPU-side checks; fla's kernels,
  the CUDA runtime against a driver and the GDN fwd+bwd need a GPU node.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

from images import rootfs as rootfs_mod
from images import wheelhouse as wh
from images.build import REPO, content_digest, inputs_digest, load_image
from tests.ansible_fixtures import (
    TEST_BASE,
    cached_rootfs_tarball,
    destroy_container,
    lxc_attach,
    run_playbook,
    write_inventory,
)

IS_ROOT = os.geteuid() == 0
HAS_TOOLS = all(shutil.which(t) for t in ("lxc-create", "lxc-start", "lxc-attach", "debootstrap", "zstd", "xz", "chroot"))
needs_root_lxc = pytest.mark.skipif(not (IS_ROOT and HAS_TOOLS), reason="needs root, lxc, debootstrap, zstd, xz")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def make_image(out: Path, *args: str, flavour: str = "test", timeout: int = 1800) -> tuple[subprocess.CompletedProcess[str], float]:
    """The build entry `make image` runs (mk/image.mk), with this interpreter."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "images.build", "--name", "trainer", "--flavour", flavour,
                           "--out", str(out), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)
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


# --- locks, wheelhouse and the inputs hash (no build) --------------------------------------------

def test_locks_pin_one_file_per_distribution() -> None:
    """Every line of the cpu and gpu locks is name==version with the sha256 of one file; the
    gpu lock's torch is the CUDA build (no +cpu), and it has fla and triton>=3.7.1."""
    for flavour in ("cpu", "gpu"):
        image = load_image("trainer", flavour)
        pins = {p.name: p for p in wh.read_lock(image.lock_file)}
        assert all(len(p.hashes) == 1 and len(p.hashes[0]) == 64 for p in pins.values()), flavour
        for needed in ("torch", "transformers", "deepspeed", "submitit", "jinja2", "pyyaml", "packaging", "matplotlib"):
            assert needed in pins, (flavour, needed)
        assert image.wheelhouse is not None and "deepspeed" in image.wheelhouse.build
    cpu = {p.name: p for p in wh.read_lock(load_image("trainer", "cpu").lock_file)}
    gpu = {p.name: p for p in wh.read_lock(load_image("trainer", "gpu").lock_file)}
    assert cpu["torch"].version == "2.13.0+cpu" and gpu["torch"].version == "2.13.0"
    assert "flash-linear-attention" in gpu and "fla-core" in gpu and "flash-linear-attention" not in cpu
    from packaging.version import Version
    assert Version(gpu["triton"].version) >= Version("3.7.1")
    assert "causal-conv1d" not in gpu and "causal-conv1d" in load_image("trainer", "gpu").wheelhouse.optional
    assert not any(name.startswith("nvidia-driver") for name in gpu), "no NVIDIA userspace driver in the image"


@pytest.mark.parametrize("line, message", [
    ("torch>=2.5", "one exact version"),
    ("torch==2.13.0 --index-url x", "only --hash"),
    ("not a requirement!", "torch.lock:1"),
])
def test_bad_lock_line_is_one_clear_error(tmp_path: Path, line: str, message: str) -> None:
    lock = tmp_path / "torch.lock"
    lock.write_text(line + "\n")
    with pytest.raises(wh.LaunchError, match=message):
        wh.read_lock(lock)


def test_target_tags_are_the_images_python_and_glibc() -> None:
    """The tags the wheelhouse accepts, against packaging's own tag parser: bookworm runs
    CPython 3.11 on glibc 2.36, so manylinux_2_36 and older, abi3 and pure wheels; not 2_39, not cp312."""
    tags = wh.Target(python="3.11", glibc="2.36").tags()
    ok = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "six-1.0-py2.py3-none-any.whl",
          "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
          "x-1.0-cp311-cp311-manylinux_2_36_x86_64.whl", "x-1.0-cp311-cp311-linux_x86_64.whl"]
    bad = ["x-1.0-cp311-cp311-manylinux_2_39_x86_64.whl", "x-1.0-cp312-cp312-manylinux_2_28_x86_64.whl",
           "x-1.0-cp311-cp311-manylinux_2_28_aarch64.whl", "x-1.0-cp311-cp311-musllinux_1_2_x86_64.whl"]
    for name in ok:
        assert wh.wheel_identity(name)[2] & tags, name
    for name in bad:
        assert not wh.wheel_identity(name)[2] & tags, name


def _tiny_wheel(src: Path, out: Path, name: str, version: str, body: str) -> Path:
    """A real wheel of a one-module project, built by pip (setuptools, no index)."""
    (src / name).mkdir(parents=True, exist_ok=True)
    (src / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n[tool.setuptools]\npackages = ["{name}"]\n')
    (src / name / "__init__.py").write_text(body)
    before = set(out.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})
    (built,) = set(out.glob("*.whl")) - before
    return built


@pytest.fixture()
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The controller's pip configured with only a local wheel directory (no index), through
    pip's own environment variables: what `make wheelhouse` honours on any controller."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def _lock_for(wheels: list[Path], path: Path) -> Path:
    lines = []
    for wheel in wheels:
        name, version, _ = wh.wheel_identity(wheel.name)
        lines.append(f"{name}=={version} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}")
    path.write_text("# test lock\n" + "\n".join(lines) + "\n")
    return path


def test_wheelhouse_fetches_the_lock_with_the_controllers_pip(tmp_path: Path, local_index: Path) -> None:
    """pip download through the controller's configuration (here: a local wheel directory);
    SHA256SUMS against hashlib; requirements.txt; a no-op re-run runs no pip; a stale wheel
    is removed; a changed wheel changes SHA256SUMS; a tampered file fails verify."""
    alpha = _tiny_wheel(tmp_path / "a", local_index, "alpha", "1.0", "A = 1\n")
    beta = _tiny_wheel(tmp_path / "b", local_index, "beta", "2.0", "B = 2\n")
    lock = _lock_for([alpha, beta], tmp_path / "req.lock")
    house = tmp_path / "house"
    sums = wh.build_wheelhouse(lock, wh.WheelhouseSpec(), house, log=lambda _: None)
    assert sorted(sums) == sorted([alpha.name, beta.name, "requirements.txt"])
    for name, digest in sums.items():
        assert hashlib.sha256((house / name).read_bytes()).hexdigest() == digest
    assert (house / "SHA256SUMS").read_text() == "".join(f"{sums[n]}  {n}\n" for n in sorted(sums))
    assert (house / "requirements.txt").read_text() == "alpha==1.0\nbeta==2.0\n"
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=house).returncode == 0
    first = wh.sums_digest(house)

    # No-op: with the wheel directory gone, nothing is fetched and nothing changes.
    shutil.rmtree(local_index)
    local_index.mkdir()
    assert wh.build_wheelhouse(lock, wh.WheelhouseSpec(), house, log=lambda _: None) == sums
    shutil.copy2(house / alpha.name, alpha)

    # A wheel not in the lock is removed; a new beta (other bytes, new hash in the lock) is fetched.
    (house / "stale-0.1-py3-none-any.whl").write_bytes(b"x")
    beta2 = _tiny_wheel(tmp_path / "b", local_index, "beta", "2.1", "B = 3\n")
    lock = _lock_for([alpha, beta2], lock)
    logged: list[str] = []
    sums2 = wh.build_wheelhouse(lock, wh.WheelhouseSpec(), house, log=logged.append)
    assert not (house / "stale-0.1-py3-none-any.whl").exists() and not (house / beta.name).exists()
    assert sums2[alpha.name] == sums[alpha.name] and beta2.name in sums2
    assert any("pip download: 1 wheels" in line for line in logged), logged
    assert wh.sums_digest(house) != first

    # A wheel whose bytes no longer match SHA256SUMS.
    with (house / alpha.name).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(wh.LaunchError, match=f"{alpha.name} does not match its sha256"):
        wh.verify(house)


def test_wheelhouse_for_the_containers_python_takes_its_wheels(tmp_path: Path, local_index: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`make wheelhouse os=ubuntu-24.04`: pip download for CPython 3.12 / glibc 2.39 (the Ubuntu
    24.04 CT), not the image's 3.11: of two builds of one version it takes the cp312 file.
    The two are a pip-built wheel under both platform names (no compiler needed)."""
    from images.make_wheelhouse import main, target_for

    target = target_for(wh.Target(), "ubuntu-24.04", None, None)
    assert (target.python, target.glibc) == ("3.12", "2.39")
    assert "--python-version 3.12 --implementation cp --abi cp312" in " ".join(target.pip_args())
    built = _tiny_wheel(tmp_path / "g", tmp_path / "built", "gamma", "1.0", "G = 1\n")
    cp312 = local_index / "gamma-1.0-cp312-cp312-manylinux_2_39_x86_64.whl"
    cp311 = local_index / "gamma-1.0-cp311-cp311-manylinux_2_36_x86_64.whl"
    shutil.copy2(built, cp312)
    shutil.copy2(built, cp311)
    with cp311.open("ab") as f:  # another build: other bytes
        f.write(b"\0")
    lock = tmp_path / "req.lock"
    lock.write_text("gamma==1.0 --hash=sha256:" + hashlib.sha256(cp312.read_bytes()).hexdigest() + "\n")
    house = tmp_path / "house"
    sums = wh.build_wheelhouse(lock, wh.WheelhouseSpec(target=target), house, log=lambda _: None)
    assert sorted(sums) == [cp312.name, "requirements.txt"]
    with pytest.raises(wh.LaunchError):  # the image's own 3.11 target cannot use that lock
        wh.build_wheelhouse(lock, wh.WheelhouseSpec(), tmp_path / "house311", log=lambda _: None)
    # No lock for the CT's Python (Debian 13: CPython 3.13): one line naming the file to make.
    assert main(["--flavour", "gpu", "--os", "debian-13", "--out", str(tmp_path / "none")]) == 2
    assert "requirements-gpu-cp313.lock" in capsys.readouterr().err


def test_cp312_lock_pins_the_gpu_locks_set_for_ubuntu_24_04(tmp_path: Path, local_index: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """requirements-gpu-cp312.lock (the Ubuntu 24.04 CT: CPython 3.12) pins the same
    distributions at the same versions as the gpu lock (CPython 3.11; none of its pins is
    3.11-only), one file each: compiled ones are other files (other hashes), deepspeed is the
    same sdist. `make wheelhouse flavour=gpu os=ubuntu-24.04` takes it by default and asks pip
    for its wheels for 3.12 / glibc 2.39 (here pip has no index, so the download fails)."""
    from images.make_wheelhouse import main

    gpu = load_image("trainer", "gpu").lock_file
    cp311 = {p.name: p for p in wh.read_lock(gpu)}
    cp312 = {p.name: p for p in wh.read_lock(gpu.with_name("requirements-gpu-cp312.lock"))}
    assert all(len(p.hashes) == 1 and len(p.hashes[0]) == 64 for p in cp312.values())
    assert {n: p.version for n, p in cp312.items()} == {n: p.version for n, p in cp311.items()}
    for compiled in ("torch", "triton", "numpy", "pydantic-core"):
        assert cp312[compiled].hashes != cp311[compiled].hashes, compiled
    assert cp312["deepspeed"].hashes == cp311["deepspeed"].hashes
    assert main(["--flavour", "gpu", "--os", "ubuntu-24.04", "--out", str(tmp_path / "house")]) == 2
    out, err = capsys.readouterr()
    assert f"pip download: {len(cp312) - 1} wheels for Python 3.12 on glibc 2.39 x86_64" in out, out
    assert err.startswith("make wheelhouse: pip download failed: ERROR"), err


def test_wheelhouse_refuses_a_wheel_whose_hash_differs_from_the_lock(tmp_path: Path, local_index: Path) -> None:
    alpha = _tiny_wheel(tmp_path / "a", local_index, "alpha", "1.0", "A = 1\n")
    lock = tmp_path / "req.lock"
    lock.write_text(f"alpha==1.0 --hash=sha256:{'0' * 64}\n")
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; from pathlib import Path; from images import wheelhouse as wh\n"
        "try:\n wh.build_wheelhouse(Path(sys.argv[1]), wh.WheelhouseSpec(), Path(sys.argv[2]), log=lambda _: None)\n"
        "except wh.LaunchError as e:\n print(e); sys.exit(2)\n"), str(lock), str(tmp_path / "house")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stdout.startswith("pip download failed: ERROR"), proc.stdout + proc.stderr
    assert "HASH" in proc.stdout.upper() and len(proc.stdout.strip().splitlines()) == 1
    assert alpha.exists() and not any((tmp_path / "house").glob("*.whl"))


def test_inputs_hash_covers_roles_wheelhouse_ansible_and_apt(tmp_path: Path) -> None:
    """Changing a role template, a wheel (hence SHA256SUMS), or the installed apt set changes
    the hash; the manifest's inputs name the Ansible versions and the project's sources."""
    base = tmp_path / "base.tar.zst"
    base.write_bytes(b"base rootfs stand-in: only its sha256 enters the hash")
    house = tmp_path / "house"
    house.mkdir()
    (house / "a-1.0-py3-none-any.whl").write_bytes(b"wheel one")
    lock = tmp_path / "a.lock"
    lock.write_text("a==1.0\n")
    wh.write_sums(house, lock)
    image = load_image("trainer", "cpu")
    digest, inputs = inputs_digest(image, base, house)
    assert digest == inputs_digest(image, base, house)[0], "same inputs, same hash"
    assert inputs["ansible"]["ansible-core"] == dist_version("ansible-core")
    assert inputs["ansible"]["community.general"][0].isdigit()
    assert len(inputs["project_sources"]) == 64
    assert inputs["wheelhouse"]["sha256sums"] == hashlib.sha256((house / "SHA256SUMS").read_bytes()).hexdigest()
    assert "ansible/roles/node_caches/templates/launch-caches.sh.j2" in inputs["files"]

    # A role template changed (in a copy of ansible/).
    ansible = tmp_path / "ansible"
    shutil.copytree(REPO / "ansible", ansible, ignore=shutil.ignore_patterns("__pycache__"))
    assert inputs_digest(load_image("trainer", "cpu", ansible_dir=ansible), base, house)[0] == digest
    with (ansible / "roles/node_caches/templates/launch-caches.sh.j2").open("a") as f:
        f.write("# changed\n")
    assert inputs_digest(load_image("trainer", "cpu", ansible_dir=ansible), base, house)[0] != digest

    # A wheel changed, and SHA256SUMS rewritten by `make wheelhouse`.
    (house / "a-1.0-py3-none-any.whl").write_bytes(b"wheel two")
    wh.write_sums(house, lock)
    assert inputs_digest(image, base, house)[0] != digest

    # The template's content hash adds the apt set read from the rootfs.
    apt = {"gcc": "4:12.2.0-3", "libc6": "2.36-9+deb12u10"}
    assert content_digest(digest, apt) == content_digest(digest, dict(reversed(apt.items())))
    assert content_digest(digest, apt) != content_digest(digest, {**apt, "libc6": "2.36-9+deb12u11"})


# --- the real builds ---------------------------------------------------------------------------

def _read_manifest(out: Path, tag: str) -> dict:
    return json.loads((out / tag / "manifest.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """The test flavour built twice from the same inputs (into two directories, the first with
    the .tar.xz rootfs lxc-create -t local takes), then a no-op re-run of the first."""
    if not (IS_ROOT and HAS_TOOLS):
        pytest.skip("needs root, lxc, debootstrap, zstd, xz")
    cached_rootfs_tarball()  # the base the Ansible tests share; built once (about a minute) if absent
    out, again = tmp_path_factory.mktemp("images"), tmp_path_factory.mktemp("images-again")
    first, first_s = make_image(out, "--lxc-xz")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr
    rebuilt, rebuilt_s = make_image(again)
    assert rebuilt.returncode == 0, rebuilt.stdout[-4000:] + rebuilt.stderr
    second, second_s = make_image(out)
    return {"out": out, "first": first, "first_s": first_s, "second": second, "second_s": second_s,
            "again": again, "rebuilt_s": rebuilt_s,
            "manifest": _read_manifest(out, "trainer-test"), "manifest_again": _read_manifest(again, "trainer-test")}


@pytest.mark.lxc
@pytest.mark.slow
def test_build_writes_template_and_manifest(built: dict) -> None:
    out, manifest = built["out"] / "trainer-test", built["manifest"]
    template = out / manifest["template"]["file"]
    assert template.is_file() and template.name.startswith(f"trainer-test_{manifest['content_hash'][:12]}_")
    assert manifest["content_hash"] == content_digest(manifest["inputs_hash"], manifest["apt_packages"])
    for artifact in ("template", "lxc_metadata", "lxc_rootfs"):
        path = out / manifest[artifact]["file"]
        assert path.stat().st_size == manifest[artifact]["size"], artifact
        assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest[artifact]["sha256"], artifact
    assert not (out / "work").exists(), "the work tree is removed after a good build"
    # Inputs: the image definition, the lock, every role file, the base rootfs identity, Ansible.
    files = manifest["inputs"]["files"]
    assert "images/trainer/image.yml" in files and "images/trainer/requirements-test.lock" in files
    assert "ansible/roles/toolchain/files/compile_check.sh" in files
    assert "ansible/roles/python_env/tasks/main.yml" in files
    assert manifest["inputs"]["base"]["tarball"] == cached_rootfs_tarball().name
    assert manifest["inputs"]["base"]["sha256"] == rootfs_mod.file_sha256(cached_rootfs_tarball())
    assert manifest["inputs"]["ansible"]["ansible-core"] == dist_version("ansible-core")
    # Versions inside.
    assert manifest["release"] == "bookworm" and "bookworm" in manifest["os"]
    for package in ("gcc", "libc6-dev", "python3-dev", "python3-venv", "systemd-sysv"):
        assert package in manifest["apt_packages"], package
    assert manifest["python"].startswith("3.11.")
    assert manifest["venv"]["path"] == "/opt/launch/venv"
    assert manifest["venv"]["packages"]["setuptools"] == "66.1.1"
    assert "gpu-train-toolkit" in manifest["venv"]["packages"], "the project is installed in the image"
    # Progress: stage lines with elapsed times, ansible summarised to one line per task.
    stdout = built["first"].stdout
    for stage in ("base rootfs:", "unpack:", "roles:", "task: toolchain : Install the compiler toolchain",
                  "pack:", "done:"):
        assert stage in stdout, stage
    assert "PLAY RECAP" not in stdout and "ok: [image]" not in stdout
    assert rootfs_mod.mounts_under(built["out"]) == [] and rootfs_mod.mounts_under(built["again"]) == []


@pytest.mark.lxc
@pytest.mark.slow
def test_two_builds_of_the_same_inputs_are_byte_identical(built: dict) -> None:
    """Built twice from scratch: the same sha256 for the template, its LXC metadata, and the
    same entries (names, modes, owners, clamped mtimes) in the tarball, in sorted order."""
    one, two = built["manifest"], built["manifest_again"]
    assert one["inputs_hash"] == two["inputs_hash"] and one["apt_packages"] == two["apt_packages"]
    assert one["template"] == two["template"], "same inputs, different template bytes"
    assert one["lxc_metadata"] == two["lxc_metadata"]
    template = built["out"] / "trainer-test" / one["template"]["file"]
    names = subprocess.run(["tar", "--zstd", "-tf", str(template)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert names[0] == "./" and names == sorted(names, key=lambda n: n.rstrip("/").split("/")), "entries not sorted"
    listing = subprocess.run(["tar", "--zstd", "--numeric-owner", "--full-time", "-tvf", str(template)],
                             capture_output=True, text=True, check=True, env={**os.environ, "TZ": "UTC"}).stdout.splitlines()
    epoch = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(one["source_date_epoch"]))
    newest = max(" ".join(line.split(None, 5)[3:5]) for line in listing)
    assert newest <= epoch, f"an entry is newer than SOURCE_DATE_EPOCH ({newest} > {epoch})"
    assert all(line.split(None, 2)[1].count("/") == 1 and line.split(None, 2)[1].replace("/", "").isdigit()
               for line in listing), "owners are not numeric"
    pax = subprocess.run(["sh", "-c", f"zstd -dcq {template} | head -c 20000000 | strings | grep -c -E '[0-9]+ (atime|ctime)=' || true"],
                         capture_output=True, text=True).stdout.strip()
    assert pax == "0", "PAX headers carry atime/ctime"


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
    changed, _ = inputs_digest(load_image("trainer", "test", images_dir), cached_rootfs_tarball())
    assert changed != built["manifest"]["inputs_hash"]
    same, _ = inputs_digest(load_image("trainer", "test"), cached_rootfs_tarball())
    assert same == built["manifest"]["inputs_hash"]


# systemctl cannot reach PID 1 until systemd has made its socket: ask again until it answers.
# `offline` (the manager not up yet) and `initializing`/`starting` are answers a loaded machine's
# booting container gives before `--wait` can wait: keep asking until another one comes
WAIT_FOR_SYSTEMD = ("for i in $(seq 120); do s=$(systemctl is-system-running --wait 2>/dev/null);"
                    " case \"$s\" in ''|offline|initializing|starting) sleep 1;; *) break;; esac; done;"
                    " echo \"${s:-no-answer}\"")


def _wait_for_systemd(lxc_path: Path, name: str) -> list[str]:
    """PID 1's binary, `systemctl is-system-running --wait`, the hostname and the machine-id
    inside the container. The machine-id is waited for too (up to 60 s): on a loaded machine a
    booting container answered the other three before systemd had written it."""
    probe = lxc_attach(lxc_path, name, f"readlink /proc/1/exe; {WAIT_FOR_SYSTEMD}; hostname; "
                       "for i in $(seq 60); do [ -s /etc/machine-id ] && break; sleep 1; done; "
                       "cat /etc/machine-id 2>/dev/null || echo no-machine-id", check=False)
    words = probe.stdout.split()
    assert len(words) >= 4, f"the container's probe printed {probe.stdout!r} (stderr {probe.stderr[-500:]!r})"
    return words


@pytest.mark.lxc
@pytest.mark.slow
def test_lxc_create_local_boots_systemd_from_the_template(built: dict, tmp_path: Path) -> None:
    """`lxc-create -t local -- --metadata M --fstree ROOTFS.tar.xz`, then lxc-start: systemd is
    PID 1 and reaches `running`, the hostname is the container's name, systemd made a
    machine-id of its own, gcc compiles against Python.h, the venv holds the project."""
    manifest, out = built["manifest"], built["out"] / "trainer-test"
    lxc_path = tmp_path / "lxc"
    lxc_path.mkdir()
    name = f"launch-local-{os.getpid()}"
    config = tmp_path / "net.conf"
    config.write_text("lxc.net.0.type = empty\n")
    try:
        subprocess.run(["lxc-create", "-P", str(lxc_path), "-n", name, "-f", str(config), "-t", "local", "--",
                        "--metadata", str(out / manifest["lxc_metadata"]["file"]),
                        "--fstree", str(out / manifest["lxc_rootfs"]["file"])], check=True, capture_output=True, timeout=300)
        assert "lxc.include = /usr/share/lxc/config/common.conf" in (lxc_path / name / "config").read_text()
        subprocess.run(["lxc-start", "-P", str(lxc_path), "-n", name], check=True, capture_output=True, timeout=60)
        init, state, hostname, machine_id = _wait_for_systemd(lxc_path, name)[:4]
        assert init.endswith("/systemd") and state in ("running", "degraded"), (init, state)
        assert hostname == name and len(machine_id) == 32
        inside = lxc_attach(lxc_path, name, (
            "set -e; printf '#include <Python.h>\\nint main(void){return 0;}\\n' > /tmp/t.c;"
            " gcc $(python3-config --includes) -c /tmp/t.c -o /tmp/t.o && echo compiled;"
            " /opt/launch/venv/bin/python -c 'import launch, train, toolkit; print(launch.__file__)'"))
        assert inside.stdout.splitlines() == ["compiled", "/opt/launch/venv/lib/python3.11/site-packages/launch/__init__.py"]
    finally:
        destroy_container(lxc_path, name)


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
        # The lxc backend makes privileged containers only (it says so unless told explicitly).
        "localhost_containers": {"hosts": {name: {"ct_cores": 1, "ct_memory_mb": 1024, "ct_unprivileged": False}}},
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
            " . /etc/profile.d/launch-caches.sh; echo $TRITON_CACHE_DIR"
        ))
        lines = inside.stdout.splitlines()
        assert lines[0].startswith("gcc (Debian 12"), inside.stdout
        assert "install ok installed" in lines[1]
        assert "python-h" in lines and "/opt/launch/venv" in lines
        assert lines[-1].startswith("/scratch/cache/")
        rootfs_release = (lxc_path / name / "rootfs" / "etc" / "os-release").read_text()
        assert "bookworm" in rootfs_release
    finally:
        destroy_container(lxc_path, name)


# --- cpu and gpu flavours: wheelhouse, build, boot, imports, doctor ------------------------------

DOCTOR_MUST_PASS = ("triton.cc", "cache.triton", "cache.hf", "cache.inductor", "versions.recorded")


def _flavour_container(tmp_path_factory: pytest.TempPathFactory, flavour: str):
    """`make wheelhouse` and `make image` for a flavour, then a container from its template by
    the lxc_container role, booted with the image's own init (systemd)."""
    if not (IS_ROOT and HAS_TOOLS):
        pytest.skip("needs root, lxc, debootstrap, zstd, xz")
    tmp = tmp_path_factory.mktemp(f"image-{flavour}")
    house = Path(os.environ.get("LAUNCH_TEST_WHEELHOUSE_DIR", "") or tmp / "wheelhouse") / flavour
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "images.make_wheelhouse", "--flavour", flavour, "--out", str(house)],
                          capture_output=True, text=True, cwd=REPO, env=ENV, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    wheelhouse_s = time.monotonic() - start
    out = tmp / "images"
    build, build_s = make_image(out, "--wheelhouse", str(house), flavour=flavour, timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr
    manifest_path = out / f"trainer-{flavour}" / "manifest.json"
    lxc_path, name = tmp / "lxc", f"launch-{flavour}-{os.getpid()}"
    lxc_path.mkdir()
    inventory = write_inventory(tmp / "inv.yml", {"all": {"children": {
        "container_hosts": {"children": {"lxc_hosts": {"hosts": {"localhost": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "lxc_container_backend": "lxc", "lxc_container_lxc_path": str(lxc_path),
            "lxc_container_template": str(manifest_path),
        }}}}},
        "localhost_containers": {"hosts": {name: {"ct_cores": 2, "ct_memory_mb": 4096, "ct_unprivileged": False}}},
    }}})
    playbook = tmp / "containers.yml"
    playbook.write_text("- name: Containers\n  hosts: container_hosts\n  gather_facts: false\n"
                        "  roles:\n    - role: lxc_container\n")
    start = time.monotonic()
    proc, recap = run_playbook(inventory, playbook=playbook, timeout=600,
                               env={"ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles")})
    boot_s = time.monotonic() - start
    assert proc.returncode == 0 and recap["localhost"]["failed"] == 0, proc.stdout[-3000:] + proc.stderr
    timings = {"wheelhouse_s": wheelhouse_s, "build_s": build_s, "boot_s": boot_s}
    print(f"\n{flavour} flavour timings: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    return {"manifest": json.loads(manifest_path.read_text()), "house": house, "lxc_path": lxc_path, "name": name,
            "timings": timings}


@pytest.fixture(scope="module")
def cpu_container(tmp_path_factory: pytest.TempPathFactory):
    ct = _flavour_container(tmp_path_factory, "cpu")
    yield ct
    destroy_container(ct["lxc_path"], ct["name"])


def _doctor_inside(ct: dict) -> tuple[int, dict[str, dict]]:
    """`launch doctor --no-gdn --json` in a login environment (the node_caches profile script)."""
    proc = lxc_attach(ct["lxc_path"], ct["name"], ". /etc/profile.d/launch-caches.sh;"
                      " /opt/launch/venv/bin/launch doctor --no-gdn --json", check=False)
    report = json.loads(proc.stdout)
    return proc.returncode, {c["check"]: c for c in report["checks"]}


@pytest.mark.lxc
@pytest.mark.slow
def test_cpu_flavour_boots_imports_and_passes_the_doctor(cpu_container: dict) -> None:
    """The cpu flavour from its wheelhouse: the venv holds exactly the lock's pins (plus the
    project), pip finds nothing broken, systemd boots it, torch/transformers/launch/train import,
    and the doctor's fast checks that must hold on a CPU node pass (the kernel checks SKIP:
    no fla in the cpu flavour)."""
    ct, manifest = cpu_container, cpu_container["manifest"]
    pins = {p.name: p.version for p in wh.read_lock(load_image("trainer", "cpu").lock_file)}
    from packaging.utils import canonicalize_name
    venv = {canonicalize_name(n): v for n, v in manifest["venv"]["packages"].items()}
    for name, version in pins.items():
        assert venv.get(name) == version, (name, venv.get(name), version)
    assert "gpu-train-toolkit" in manifest["venv"]["packages"]
    assert manifest["inputs"]["wheelhouse"]["sha256sums"] == hashlib.sha256((ct["house"] / "SHA256SUMS").read_bytes()).hexdigest()
    init, state = _wait_for_systemd(ct["lxc_path"], ct["name"])[:2]
    assert init.endswith("/systemd") and state in ("running", "degraded"), (init, state)
    imports = lxc_attach(ct["lxc_path"], ct["name"], "/opt/launch/venv/bin/python -c 'import torch, transformers, launch, train;"
                         " print(torch.__version__, transformers.__version__)'; /opt/launch/venv/bin/python -m pip check")
    assert imports.stdout.splitlines() == [f"{pins['torch']} {pins['transformers']}", "No broken requirements found."]
    rc, checks = _doctor_inside(ct)
    for check in DOCTOR_MUST_PASS:
        assert checks[check]["status"] == "PASS", checks[check]
    assert checks["kernels.fla"]["status"] == "SKIP" and checks["gpus.count"]["status"] in ("SKIP", "PASS")
    assert rc == 0 and not [c for c in checks.values() if c["status"] == "FAIL"], checks


@pytest.fixture(scope="module")
def gpu_container(tmp_path_factory: pytest.TempPathFactory):
    if os.environ.get("LAUNCH_TEST_GPU_IMAGE") != "1":
        pytest.skip("the gpu flavour's wheels are several GB: set LAUNCH_TEST_GPU_IMAGE=1 to build it (not in CI)")
    ct = _flavour_container(tmp_path_factory, "gpu")
    yield ct
    destroy_container(ct["lxc_path"], ct["name"])


@pytest.mark.lxc
@pytest.mark.slow
def test_gpu_flavour_boots_and_imports_fla(gpu_container: dict) -> None:
    """On a machine without a GPU: the gpu flavour boots, fla and its Triton causal conv import,
    Triton's C compiler works, torch is the CUDA build, no NVIDIA driver userspace is in the
    image. Not checked here: CUDA against a driver, fla's kernels, the GDN fwd+bwd (a GPU node)."""
    ct, manifest = gpu_container, gpu_container["manifest"]
    assert not [p for p in manifest["apt_packages"] if p.startswith(("nvidia", "libnvidia", "libcuda"))]
    init, state = _wait_for_systemd(ct["lxc_path"], ct["name"])[:2]
    assert init.endswith("/systemd") and state in ("running", "degraded"), (init, state)
    imports = lxc_attach(ct["lxc_path"], ct["name"], "/opt/launch/venv/bin/python -c 'import torch, transformers, fla, launch, train;"
                         " print(torch.version.cuda is not None, torch.cuda.is_available())'; test ! -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 && echo no-driver")
    assert imports.stdout.splitlines() == ["True False", "no-driver"], imports.stdout + imports.stderr
    rc, checks = _doctor_inside(ct)
    for check in (*DOCTOR_MUST_PASS, "kernels.fla", "kernels.causal_conv"):
        assert checks[check]["status"] == "PASS", checks[check]
