"""Bad inputs found by the red team of issue 39 (see tests/badinputs/__init__.py for what a case
is): files the run did not write, hangs on a FIFO or a YAML alias bomb, silent acceptances.
Each row is in the category of the input it breaks."""

from __future__ import annotations

import os
from pathlib import Path

from tests.badinputs import Case

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def _run_folder(config: str | None = None, fifo: bool = False):  # noqa: ANN202 - a Case.setup
    """Job 1's run folder with a checkpoint to resume from, and its config.yaml as given."""
    def setup(tmp: Path) -> None:
        run = tmp / "runs" / "1"
        (run / "checkpoints" / "step_00000002").mkdir(parents=True)
        (run / "checkpoints" / "step_00000002" / "MANIFEST.json").write_text("{}")
        if fifo:
            os.mkfifo(run / "config.yaml")
        elif config is not None:
            (run / "config.yaml").write_text(config)
    return setup


def _copied_run(config: str):  # noqa: ANN202 - a Case.setup
    """{tmp}/copy: a run folder moved or copied from elsewhere, with a checkpoint and this config.yaml."""
    def setup(tmp: Path) -> None:
        (tmp / "copy" / "checkpoints" / "step_00000002").mkdir(parents=True)
        (tmp / "copy" / "checkpoints" / "step_00000002" / "MANIFEST.json").write_text("{}")
        (tmp / "copy" / "config.yaml").write_text(config)
    return setup


def _dead_slurm_and(setup):  # noqa: ANN001, ANN202 - a Case.setup
    """Job 1 recorded on a Slurm whose controller does not answer, then `setup`."""
    from tests.badinputs.cli_cases import DEAD_SLURM, _record_with

    def both(tmp: Path) -> None:
        (tmp / "dead.conf").write_text(DEAD_SLURM)
        _record_with(slurm_conf="{tmp}/dead.conf")(tmp)
        setup(tmp)
    return both


CASES = [
    # ---- config.yaml of a run: read bounded, never hanging on a FIFO or expanding an alias bomb
    Case("cli", "resume-config-yaml-fifo", ["resume", "1", "--steps", "9"],
         r"config\.yaml not read \(not a regular file\)", job_record=True, entry="launch-process",
         setup=_run_folder(fifo=True)),
    Case("cli", "resume-config-yaml-alias-bomb", ["resume", "1", "--steps", "9"],
         r"config\.yaml not read \(YAML aliases are not written by the launcher\)", job_record=True,
         entry="launch-process", setup=_run_folder(ALIAS_BOMB)),
    # `status` names a broken config.yaml too, with Slurm down as with it up
    Case("cli", "status-config-yaml-fifo", ["status", "1"], r"\S*runs/1/config\.yaml not read \(not a regular file\); the "
         r"run's config is not shown\n.*Slurm not reachable", entry="launch-process",
         setup=_dead_slurm_and(_run_folder(fifo=True))),
    Case("cli", "status-config-yaml-alias-bomb", ["status", "1"],
         r"\S*runs/1/config\.yaml not read \(YAML aliases are not written by the launcher\)", entry="launch-process",
         setup=_dead_slurm_and(_run_folder(ALIAS_BOMB))),
    # ---- a resume continues its run in its folder
    Case("cli", "resume-arg-out", ["resume", "1", "--arg", "out={tmp}/elsewhere"],
         r"--arg out=\S*elsewhere: a resume continues job 1's run in \S*runs/1; submit a new job", job_record=True,
         setup=_run_folder()),
    # ---- `launch resume DIR`: a copied run folder continues with the command line of the job its
    # config.yaml names, only a job submitted from here and of the kind config.yaml says
    Case("cli", "resume-dir-missing", ["resume", "{tmp}/nowhere/run", "--steps", "9"],
         r"\S*nowhere/run: no such run folder"),
    Case("cli", "resume-dir-names-no-job", ["resume", "{tmp}/copy", "--steps", "9"],
         r"\S*copy/config\.yaml names no job \('x; rm -rf'\): not a run folder a job wrote; start one there with "
         r"`launch submit JOB --arg out=\S*copy`", job_record=True, setup=_copied_run("job_id: 'x; rm -rf'\n")),
    Case("cli", "resume-dir-job-not-here", ["resume", "{tmp}/copy", "--steps", "9"],
         r"\S*copy is a run of job 77 \(\S*copy/config\.yaml\), but job 77 was not submitted from here",
         job_record=True, setup=_copied_run("job_id: '77'\njob: fixture\n")),
    Case("cli", "resume-dir-another-kind", ["resume", "{tmp}/copy", "--steps", "9"],
         r"\S*copy/config\.yaml names job 1 of 'extract', but job 1 ran 'fixture': not resumed with another job's "
         "command line", job_record=True, setup=_copied_run("job_id: '1'\njob: extract\n")),
]

SPEC = "{tmp}/job.yaml"
GOOD_SPEC = """name: demo
entrypoint: fixture_entry
resources: {nodes: 1, gpus_per_node: 0, cpus_per_task: 1, time: "00:05:00"}
env: {A: "1"}
presets:
  small: {args: {sleep: 0}}
"""


def _hijack(key: str) -> Case:
    return Case("job-spec", f"spec-env-hijack-{key.lower().replace('_', '-')}", ["submit", SPEC, "--dry-run"],
                rf"key 'env.{key}': environment key {key} chooses which code the job runs .*a job spec may not set it",
                {"job.yaml": GOOD_SPEC.replace('A: "1"', f'{key}: "/tmp/x"')})


CASES += [_hijack(key) for key in ("SLURM_TASK_PROLOG", "SLURM_TASK_EPILOG", "OPENSSL_CONF", "OPENSSL_MODULES", "CC",
                                   "CXX", "PYTHONWARNINGS")]
CASES += [
    Case("cli", "env-hijack-slurm-task-prolog", ["submit", "fixture", "--dry-run", "--env", "SLURM_TASK_PROLOG=/tmp/x"],
         r"environment key SLURM_TASK_PROLOG chooses which code the job runs"),
]
CASES += [
    Case("cli", "arg-job-output-absolute", ["submit", "fixture", "--arg", "sleep=job:1//etc", "--dry-run"],
         r"--arg sleep=job:1//etc: the path after job:<id>/ stays inside that job's run folder \(no '\.\.', no "
         r"leading '/'\)", job_record=True),
]

STAGE1_SUBMIT = ["submit", "stage1", "--preset", "tiny", "--dry-run"]


def _safetensors(path: Path, cut: bool = False) -> None:
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16), "lm_head.weight": torch.zeros(64, 16)}, str(path))
    if cut:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncated_checkpoint(tmp: Path) -> None:
    (tmp / "ckpt").mkdir()
    (tmp / "ckpt" / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    _safetensors(tmp / "ckpt" / "model.safetensors", cut=True)


def _half_a_checkpoint(tmp: Path) -> None:
    """The tiny Qwen3.5 checkpoint with every linear-attention (GDN) tensor left out, as a copy
    that stopped half-way would leave it (its safetensors file whole, just without them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.badinputs import built
    from tests.badinputs.stage1_data_cases import _quiet, _synthetic
    from tests.hf_fixtures import make_checkpoint

    full = built("tiny-hf-checkpoint", lambda d: _quiet(lambda: make_checkpoint(d)))
    shutil.copytree(full, tmp / "ckpt")
    weights = tmp / "ckpt" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if "linear_attn" not in k}, str(weights), metadata={"format": "pt"})
    (tmp / "data").symlink_to(built("stage1-synthetic", _synthetic), target_is_directory=True)


CASES += [
    Case("cli", "stage1-min-lr-ratio-negative", [*STAGE1_SUBMIT, "--arg", "min_lr_ratio=-0.5"],
         r"--arg min_lr_ratio must be between 0 and 1 \(a fraction of --arg lr\), got -0\.5"),
    Case("cli", "stage1-min-lr-ratio-above-one", [*STAGE1_SUBMIT, "--arg", "min_lr_ratio=1.5"],
         r"--arg min_lr_ratio must be between 0 and 1"),
    Case("cli", "init-from-truncated-safetensors-at-submit", [*STAGE1_SUBMIT, "--arg", "init_from={tmp}/ckpt"],
         r"--arg init_from=\S*ckpt: model\.safetensors is damaged or truncated \(SafetensorError: .*nothing submitted",
         setup=_truncated_checkpoint),
    Case("cli", "init-from-another-architecture-at-submit", [*STAGE1_SUBMIT, "--arg", "init_from={tmp}/ckpt"],
         r"--arg init_from=\S*ckpt: a 'llama' model \(no architectures\), not 'qwen3_5' or 'qwen3_5_text': this trainer "
         r"cannot start from it", {"ckpt/config.json": '{"model_type": "llama"}'}),
    Case("cli", "init-from-pickled-weights-only-at-submit", [*STAGE1_SUBMIT, "--arg", "init_from={tmp}/ckpt"],
         r"--arg init_from=\S*ckpt: its weights are pickles \(pytorch_model\.bin\), and only safetensors weights are "
         r"loaded", {"ckpt/config.json": '{"model_type": "qwen3_5_text"}', "ckpt/pytorch_model.bin": b"PK\x03\x04"}),
    Case("cli", "init-from-index-names-an-absent-shard", [*STAGE1_SUBMIT, "--arg", "init_from={tmp}/ckpt"],
         r"--arg init_from=\S*ckpt: model\.safetensors\.index\.json names model-00002-of-00002\.safetensors, which is not "
         r"there", {"ckpt/config.json": '{"model_type": "qwen3_5_text"}', "ckpt/model.safetensors.index.json":
                    '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}',
                    "ckpt/model-00001-of-00002.safetensors": b""}),
    Case("checkpoint", "init-from-missing-half-its-weights",
         ["--shape", "tiny", "--batch-rows", "1", "--row-len", "128", "--num-workers", "0", "--steps", "1",
          "--export", "off", "--out", "{tmp}/run", "--data-dir", "{tmp}/data", "--init-from", "{tmp}/ckpt"],
         r"--init-from \S*ckpt: \d+ of the model's weights are not in the checkpoint or do not fit it "
         r"\(e\.g\. \S*linear_attn\S*\); they would start from random init", entry="stage1", setup=_half_a_checkpoint),
    Case("cli", "dflash-mask-token-negative", ["--mask-token", "-1", "--data", "{tmp}/x"],
         r"--mask-token -1: id -1 is not a row of an embedding \(ids are >= 0\)", entry="dflash"),
    Case("cli", "dflash-mask-token-huge", ["--mask-token", "99999999999999999999999", "--data", "{tmp}/x"],
         r"--mask-token 99999999999999999999999: id \d+ is not a row of an embedding", entry="dflash"),
]

DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit


def _stage1_data_with_deep_line(tmp: Path) -> None:
    _stage1_data_with(DEEP)(tmp)


def _stage1_data_with(line: str):  # noqa: ANN202 - a Case.setup: the synthetic data, `line` appended to replay_text
    def setup(tmp: Path) -> None:
        from tests.badinputs.stage1_data_cases import append_line, data

        data(append_line("replay_text", line))(tmp)
    return setup


def _stage1_strict() -> list[str]:
    from tests.badinputs.stage1_data_cases import STRICT

    return STRICT


CASES += [
    Case("stage1-data", "record-nested-too-deeply", _stage1_strict(),
         r"1 of \d+ records malformed .*first: \S*replay_text\.jsonl:5: invalid JSON \(nested too deeply",
         entry="stage1", setup=_stage1_data_with_deep_line),
    # nested within the parser's limit (which torch's compiler raises to 2000 in a GPU job): bounded all the same
    Case("stage1-data", "record-nested-500-deep-counted", [*_stage1_strict()[:-1], "0.9"],
         r"malformed record: \S*replay_text\.jsonl:5: invalid JSON \(nested too deeply: more than 64 levels\)",
         entry="stage1", outcome="counted", setup=_stage1_data_with(
             '{"id": "x", "text": "t", "extra": ' + "[" * 500 + "]" * 500 + "}")),
    Case("stage1-data", "record-nested-too-deeply-counted", [*_stage1_strict()[:-1], "0.9"],
         r"malformed record: \S*replay_text\.jsonl:5: invalid JSON \(nested too deeply", entry="stage1",
         outcome="counted", setup=_stage1_data_with_deep_line),
]


def _fifo(name: str):  # noqa: ANN202 - a Case.setup
    return lambda tmp: os.mkfifo(tmp / name)


def _sparse(name: str, size: int):  # noqa: ANN202 - a Case.setup: a file of `size` bytes that takes no disk
    def setup(tmp: Path) -> None:
        with open(tmp / name, "wb") as f:
            f.truncate(size)
    return setup


CASES += [
    # a FIFO would block the reader forever: a child with a timeout, as a hang would be caught
    Case("cli", "buckets-fifo", ["buckets", "{tmp}/l.txt"], r"l\.txt: not a regular file \(a FIFO, device or socket\)",
         entry="launch-process", setup=_fifo("l.txt")),
    Case("cli", "buckets-dev-zero", ["buckets", "/dev/zero"], r"/dev/zero: not a regular file", entry="launch-process"),
    Case("cli", "buckets-huge", ["buckets", "{tmp}/l.txt"], r"l\.txt: 4096 MiB, over the 256 MiB a lengths file may have",
         setup=_sparse("l.txt", 4 << 30)),
    Case("cli", "buckets-length-beyond-int64", ["buckets", "{tmp}/l.txt"],
         r"l\.txt:2: a length of 23 digits, past the largest a length may be \(9223372036854775807\)",
         {"l.txt": "5\n99999999999999999999999\n"}),
    Case("cli", "buckets-npy-float", ["buckets", "{tmp}/l.npy"],
         r"l\.npy: not a \.npy array of lengths \(it holds float64 values, not integers\)",
         setup=lambda tmp: _npy(tmp / "l.npy", "<f8", (3,), b"\0" * 24)),
    Case("cli", "buckets-npy-header-claims-1e11", ["buckets", "{tmp}/l.npy"],
         r"l\.npy: not a \.npy array of lengths \(its header claims 100000000000 entries \(800000000000 bytes\), the "
         r"file holds 24 bytes of data\)", setup=lambda tmp: _npy(tmp / "l.npy", "<i8", (10**11,), b"\1" * 24)),
]


def _npy(path: Path, descr: str, shape: tuple[int, ...], data: bytes) -> None:
    """A .npy file of format 1.0 whose header says `descr` and `shape`, followed by `data`."""
    import struct

    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}".encode()
    header = header.ljust(-(10 + len(header) + 1) % 64 + len(header)) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data)


STAGE1_SUBMIT_ARG = ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg"]
CASES += [
    Case("cli", "stage1-wandb-project-empty", [*STAGE1_SUBMIT_ARG, "wandb_project="],
         r"(--wandb-project|--arg wandb_project) is empty: name the wandb project, or leave the option out"),
    # a switch: a preset's `vision_ckpt: true` or the trainer's --vision-ckpt (`--arg vision_ckpt=on` is not a switch's
    # spelling, and is refused as such)
    Case("cli", "stage1-vision-ckpt-with-vision-off", ["--shape", "tiny", "--steps", "1", "--vision-ckpt", "--vision",
                                                       "off", "--weights", '{"und": 1}', "--out", "{tmp}/run"],
         r"--vision-ckpt on checkpoints the vision tower's blocks, and --vision off has no tower", entry="stage1"),
]


def _inventory() -> list[Case]:
    from tests.badinputs.inventory_cases import CT, _case, kpro6

    ct201 = {"ct_vmid": 201, "proxmox_vmid": 201, "ct_hostname": "trainer201"}
    return [
        _case("constrain-devices-one", kpro6({"slurm_constrain_devices": 1}),
              rf"{CT}: slurm_constrain_devices=1 is not one of auto, yes, no"),
        _case("constrain-devices-maybe", kpro6({"slurm_constrain_devices": "maybe"}),
              rf"{CT}: slurm_constrain_devices='maybe' is not one of auto, yes, no"),
        _case("gpu-03-and-3-in-two-containers",
              kpro6({"ct_gpus": [0, 1, 2, 3]}, more={"kpro6-ct201": {**ct201, "ct_gpus": ["03", 4]}}),
              r"kpro6-ct201: ct_gpus has GPU 03, which kpro6-ct200 has too; a GPU passes through to one container"),
        # an unprivileged CT whose root maps to host root; refused on the host, and on a container too
        _case("container-unprivileged-root-uid-zero", kpro6({"lxc_container_unprivileged_root_uid": 0}),
              rf"{CT}: lxc_container_unprivileged_root_uid=0 is out of range"),
        # every problem of the file at once, one a line: the missing checksum hides nothing
        _case("every-problem-at-once", kpro6({"nvidia_userspace_sha256": None, "ct_memory_mb": 8}),
              rf"(?s){CT}: ct_memory_mb=8 is out of range.*\ninventory error: {CT}: nvidia_userspace_sha256 is not set"),
        _case("scratch-shared-but-for-a-trailing-slash", kpro6(more={"kpro6-ct201": {
                  **ct201, "ct_gpus": [], "ct_unprivileged": False, "ct_scratch_host_path": "/mnt/nvme-scratch/ct200/"}}),
              r"kpro6-ct201: ct_scratch_host_path=/mnt/nvme-scratch/ct200/ is also kpro6-ct200's, and one of the two is "
              "privileged"),
    ]


CASES += _inventory()


def _dir(name: str, mode: int, owner: int | None = None):  # noqa: ANN202 - a Case.setup
    def setup(tmp: Path) -> None:
        (tmp / name).mkdir()
        (tmp / name).chmod(mode)
        if owner is not None:
            os.chown(tmp / name, owner, owner)
    return setup


CASES += [
    # another uid could swap the job folder (and its pickle) before the job starts
    Case("cli", "runs-dir-parent-world-writable", ["submit", "fixture", "--runs-dir", "{tmp}/shared/runs", "--dry-run"],
         r"runs directory \S*shared/runs: \S*shared is writable by other users \(mode 777, no sticky bit\), who could "
         r"swap a job folder", setup=_dir("shared", 0o777)),
    Case("cli", "out-inside-another-uids-dir", [*STAGE1_SUBMIT, "--arg", "out={tmp}/theirs/run"],
         r"run folder \S*theirs/run: \S*theirs belongs to uid 65534, another user, who could swap its checkpoints",
         setup=_dir("theirs", 0o755, 65534)),
    Case("cli", "out-under-a-world-writable-dir", [*STAGE1_SUBMIT, "--arg", "out={tmp}/shared/run"],
         r"run folder \S*shared/run: \S*shared is writable by other users \(mode 777, no sticky bit\)",
         setup=_dir("shared", 0o777)),
    Case("cli", "runs-dir-owned-by-another-uid", ["submit", "fixture", "--runs-dir", "{tmp}/theirs", "--dry-run"],
         r"runs directory \S*theirs: \S*theirs belongs to uid 65534, another user", setup=_dir("theirs", 0o755, 65534)),
]


# Kernel archives (issue 47): a manifest or store a user can edit or another uid can swap
KERNEL_MANIFEST = {"key": "sm_90-cuda13.0-0123456789abcdef", "archive": "a" * 64 + ".tar.gz", "sha256": "a" * 64,
                   "bytes": 10, "files": {"triton": 1}, "note": "", "created": 1.7e9}


def _manifest(**fields):  # noqa: ANN202 - a Case.setup
    def setup(tmp: Path) -> None:
        import json

        (tmp / "store").mkdir()
        (tmp / "store" / "sm_90-cuda13.0-0123456789abcdef.json").write_text(json.dumps({**KERNEL_MANIFEST, **fields}))
    return setup


def _fifo_manifest(tmp: Path) -> None:
    (tmp / "store").mkdir()
    os.mkfifo(tmp / "store" / "sm_90-cuda13.0-0123456789abcdef.json")


STORE_ENV = {"LAUNCH_KERNEL_ARCHIVES": "{tmp}/store"}
CASES += [
    Case("cli", f"kernels-list-manifest-{name}", ["kernels", "list"], expect, env=STORE_ENV, setup=_manifest(**fields))
    for name, fields, expect in [
        ("files-a-list", {"files": ["triton"]}, r"manifest \S+\.json: 'files' is not a mapping of cache name to a file count"),
        ("count-not-an-int", {"files": {"triton": "80"}}, r"'files' is not a mapping of cache name to a file count"),
        ("archive-not-a-string", {"archive": 5}, r"'archive' is not '<sha256>\.tar\.gz' \(found 5\)"),
        ("archive-a-path", {"archive": "../../etc/passwd"}, r"'archive' is not '<sha256>\.tar\.gz'"),
        ("created-yesterday", {"created": "yesterday"}, r"'created' is not a time in seconds \(found 'yesterday'\)"),
        ("bytes-a-string", {"bytes": "10"}, r"'bytes' is not a byte count \(found '10'\)"),
    ]
] + [
    Case("cli", "kernels-list-manifest-fifo", ["kernels", "list"], r"manifest \S+\.json is not a regular file",
         env=STORE_ENV, setup=_fifo_manifest, entry="launch-process"),
    Case("cli", "kernels-list-store-another-uids", ["kernels", "list"],
         r"kernel archive store \S+/store belongs to uid 65534, another user", env=STORE_ENV,
         setup=_dir("store", 0o1777, 65534)),
    Case("cli", "kernels-bake-store-a-file", ["kernels", "bake", "--preset", "tiny", "--dry-run"],
         r"kernel archive store \S+/store exists and is not a directory; set LAUNCH_KERNEL_ARCHIVES to a directory; "
         r"nothing submitted", env=STORE_ENV, files={"store": "not a directory"}),
]


def _stage1_run_folder(tmp: Path) -> None:
    (tmp / "run").mkdir()
    (tmp / "run" / "outcome.json").write_text('{"state": "completed", "step": 3, "trainer": "stage1", "job": "7"}')


CASES += [
    # a run folder belongs to one trainer: an extraction there would replace the stage-1 run's files
    Case("cli", "out-holds-another-trainers-run", ["submit", "extract", "--preset", "tiny", "--dry-run", "--arg",
                                                   "out={tmp}/run"],
         r"run folder \S+/run holds a stage1 run; extract \(train\.extract\) would replace its config, summary and "
         r"outcome: give another --arg out=; nothing submitted", setup=_stage1_run_folder),
]
