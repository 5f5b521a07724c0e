"""bench/install_kernels.py with real pip: wheels that share one top-level folder, installed into
one --target in several calls (as the CUTLASS DSL's -libs-core, -libs-base and -libs-cu12 wheels all
write into nvidia_cutlass_dsl/, the last one joined from parts and installed in a later call)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("install_kernels", REPO / "bench" / "install_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of `files` (path -> text), as a build backend writes one."""
    dist = f"{name.replace('-', '_')}-{version}"
    body = {**files,
            f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in body.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in {**body, f"{dist}.dist-info/RECORD": "\n".join(record) + "\n"}.items():
            z.writestr(member, text)
    return path


def test_wheels_sharing_a_folder_survive_installs_in_separate_calls(tmp_path: Path, capsys) -> None:
    mod = _module()
    first, second, target = tmp_path / "first", tmp_path / "second", tmp_path / "target"
    first.mkdir()
    second.mkdir()
    core = _wheel(first, "demo-core", "1.0", {"shared/pkgs/demo/__init__.py": "CORE = 1\n"})
    flavour = _wheel(second, "demo-flavour", "1.0", {"shared/pkgs/demo/_lib_flavour.py": "FLAVOUR = 1\n"})
    lock = tmp_path / "gpu.lock"
    lock.write_text("".join(f"{n}==1.0 --hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}\n"
                            for n, w in (("demo-core", core), ("demo-flavour", flavour))))
    for folder in (first, second, first):  # the last: the same pin again (a rerun of the step)
        assert mod.main(["--lock", str(lock), "--wheels", str(folder), "--target", str(target)]) == 0
    # `pip install --target --upgrade` alone keeps only the last call's shared/ (the H200's
    # `No module named 'cutlass.cute'` once the .pth was read)
    assert (target / "shared/pkgs/demo/__init__.py").read_text() == "CORE = 1\n"
    assert (target / "shared/pkgs/demo/_lib_flavour.py").read_text() == "FLAVOUR = 1\n"
    assert sorted(p.name for p in target.iterdir()) == ["demo_core-1.0.dist-info", "demo_flavour-1.0.dist-info", "shared"]
    assert mod.main(["--lock", str(lock), "--target", str(target), "--check"]) == 1  # no kernel set: named, not crashed
    capsys.readouterr()
    # a package reinstalled at another version: the old version's files and dist-info go
    core2 = _wheel(first, "demo-core", "2.0", {"shared/pkgs/demo/__init__.py": "CORE = 2\n",
                                                "shared/pkgs/demo/new.py": ""})
    core.unlink()
    lock.write_text(lock.read_text().replace(
        lock.read_text().splitlines()[0], f"demo-core==2.0 --hash=sha256:{hashlib.sha256(core2.read_bytes()).hexdigest()}"))
    (target / "shared/pkgs/demo/__init__.py").write_text("CORE = 1\n")
    assert mod.main(["--lock", str(lock), "--wheels", str(first), "--target", str(target)]) == 0
    assert (target / "shared/pkgs/demo/__init__.py").read_text() == "CORE = 2\n"
    assert (target / "shared/pkgs/demo/_lib_flavour.py").is_file()
    assert not (target / "demo_core-1.0.dist-info").exists() and (target / "demo_core-2.0.dist-info").is_dir()
    assert not list(target.glob(".install-*"))
