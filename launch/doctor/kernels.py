"""Kernel checks: fla and a varlen causal conv import, a tiny GDN fwd+bwd on the GPU against
the reference, and the known-bad version combinations."""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status
from launch.doctor.versions import dist_version
from toolkit import pyexec

PROBE_SOURCE = Path(__file__).with_name("kernel_probe.py")

# qwen3_5 with cu_seq_lens-aware packing landed in transformers 5.9 (pyproject's floor).
TRANSFORMERS_MIN_PACKING = Version("5.9")
# 5.23 refuses packed rows when no conv kernel is present; 5.17 was seen mixing documents
# silently instead. Between the two the behaviour is unverified, so it is only a WARN.
TRANSFORMERS_REFUSES_UNSAFE_PACKING = Version("5.23")
# fla's gated-delta-rule backward is wrong on Hopper with these Triton versions (fla 0.6.0
# refuses with "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results").
HOPPER_BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))
GDN_TOLERANCE = 0.02  # relative RMS error, bf16 kernel vs float32 reference
FLA_INSTALL = (
    "pip install flash-linear-attention (extra 'gpu'; offline, from a local wheel directory: "
    "pip install --no-index --find-links DIR flash-linear-attention)"
)


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def is_hopper(ctx: DoctorContext, probe: dict) -> bool:
    caps = [g.compute_cap for g in ctx.gpus or [] if g.compute_cap]
    caps += [tuple(c) for c in probe.get("torch", {}).get("capabilities", [])]
    return any(c[0] == 9 for c in caps)


def triton_in_bad_range() -> str | None:
    v = _version(dist_version("triton"))
    if v is not None and HOPPER_BAD_TRITON[0] <= v < HOPPER_BAD_TRITON[1]:
        return str(v)
    return None


def trainer_set(ctx: DoctorContext) -> tuple[str, str, dict] | None:
    """(entrypoint, device type, kernel arguments) of the job whose kernel set the probe checks
    through the trainer's own selection; None without a job, and in the in-job preflight (the
    trainer makes the same check itself moments later, and knows about --allow-slow-path)."""
    job = ctx.job
    if job is None or job.resolved is None or ctx.preflight:
        return None
    choices = {k: v for k, v in job.resolved.args.items() if isinstance(v, str)}
    return job.resolved.spec.entrypoint, "cuda" if ctx.needs_gpus else "cpu", choices


def run_probe(ctx: DoctorContext, *, gdn: bool, tilelang: bool) -> dict:
    """Run kernel_probe.py in a child interpreter with the job's environment."""
    timeout = float(ctx.env.get("LAUNCH_DOCTOR_PROBE_TIMEOUT", "900" if gdn else "180"))
    with tempfile.TemporaryDirectory(prefix="launch-doctor-") as tmp:
        out = Path(tmp) / "probe.json"
        cmd = pyexec.python("-c", PROBE_SOURCE.read_text(), "--out", str(out))
        cmd += ["--gdn"] * gdn + ["--tilelang"] * tilelang + ["--torch"] * ctx.has_cuda_gpus
        trainer = trainer_set(ctx)
        if trainer is not None:
            cmd += ["--trainer", trainer[0], "--device", trainer[1], "--choices", json.dumps(trainer[2])]
        try:
            proc = subprocess.run(cmd, env=dict(ctx.env), capture_output=True, text=True, timeout=timeout)
            crash = None
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or [""])[-1]
                how = f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exited {proc.returncode}"
                crash = f"importing the kernels {how} (a broken extension?): {tail}"
        except subprocess.TimeoutExpired:
            crash = f"kernel probe did not finish in {timeout:.0f} s (set LAUNCH_DOCTOR_PROBE_TIMEOUT)"
        report = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {"imports": {}}
    if crash is None and not report.get("done"):
        # exit status 0 without the probe's last line: something it imported ended the interpreter
        # (sys.exit or os._exit in a package's import), which the rows must say, not "not checked"
        during = f" while importing {report['importing']}" if report.get("importing") else ""
        crash = f"the kernel probe exited{during} before it finished (the package's import ends the process)"
    elif crash is not None and report.get("importing"):
        crash += f" (while importing {report['importing']})"
    report["crash"] = crash
    return report


def _import_result(name: str, res: dict | None, required: bool, fix: str, crash: str | None) -> CheckResult:
    if res is None:
        return CheckResult(name, Status.FAIL if required else Status.WARN, crash or "not checked", fix)
    if res["ok"]:
        return CheckResult(name, Status.PASS, "imports")
    found = "not installed" if res["not_installed"] else res["error"]
    if res["not_installed"] and not required:
        return CheckResult(name, Status.SKIP, f"{found}; not needed without a GPU (reference kernels)")
    return CheckResult(name, Status.FAIL if required else Status.WARN, found, fix)


def check_kernels(ctx: DoctorContext) -> list[CheckResult]:
    required = ctx.needs_gpus
    hopper_triton = triton_in_bad_range() if ctx.has_cuda_gpus else None
    probe = run_probe(ctx, gdn=ctx.run_gdn and ctx.has_cuda_gpus, tilelang=hopper_triton is not None)
    imports, crash = probe["imports"], probe["crash"]
    results: list[CheckResult] = []

    fla = imports.get("fla")
    fla_result = _import_result("kernels.fla", fla, required, FLA_INSTALL, crash)
    if fla and fla["ok"]:
        fla_result = _import_result(
            "kernels.fla", imports.get("fla.gated_delta_rule"), required,
            "reinstall flash-linear-attention/fla-core of one version", crash,
        )
    if fla_result.status is Status.PASS:
        fla_result = CheckResult("kernels.fla", Status.PASS, f"fla {dist_version('flash-linear-attention') or dist_version('fla-core')}: chunk_gated_delta_rule imports")
    results.append(fla_result)

    # The conv that keeps packed documents apart: causal-conv1d (seq_idx) or fla's own Triton
    # causal_conv1d (cu_seqlens), either one will do.
    cc, fla_cc = imports.get("causal_conv1d"), imports.get("fla.causal_conv1d")
    if cc and cc["ok"]:
        results.append(CheckResult("kernels.causal_conv", Status.PASS, f"causal_conv1d {dist_version('causal-conv1d')} imports"))
    elif fla_cc and fla_cc["ok"]:
        why = "not installed" if cc and cc["not_installed"] else (cc or {}).get("error") or crash
        status = Status.PASS if cc is None or cc["not_installed"] else Status.WARN
        results.append(CheckResult(
            "kernels.causal_conv", status, f"fla's Triton causal_conv1d (varlen) imports; causal_conv1d: {why}",
            "" if status is Status.PASS else "fix or uninstall causal-conv1d (transformers would try it first)",
        ))
    else:
        conv_fix = "pip install causal-conv1d (built for this torch/CUDA), or fix fla so its causal_conv1d imports"
        res = _import_result("kernels.causal_conv", cc, required, conv_fix, crash)
        if fla_cc is not None and not fla_cc["ok"]:
            res = CheckResult(res.check, res.status, f"{res.found}; fla's causal_conv1d: {fla_cc['error']}", res.fix)
        results.append(res)

    results.append(_gdn_result(ctx, probe, fla_result.status is Status.PASS))
    results.append(_hopper_result(ctx, probe, hopper_triton))
    results.extend(_transformers_results(cc_ok=bool(cc and cc["ok"])))
    results.extend(_trainer_results(ctx, probe))
    return results


# plan_kernels' piece names -> row names
TRAINER_ROWS = {"gated delta rule": "gdn", "gated-delta-rule backend": "backend", "causal conv": "conv",
                "loss": "loss", "attention": "attention"}


def _trainer_results(ctx: DoctorContext, probe: dict) -> list[CheckResult]:
    """One row per kernel of the job's set, as the trainer selects it at start (the same imports
    and probes; train.common.fastpath.kernel_rows): a fallback it would refuse is a FAIL here
    where the job needs GPUs, with the install command at the GPU lock's pin."""
    trainer = trainer_set(ctx)
    if trainer is None:
        return []
    entrypoint, device, _ = trainer
    report = probe.get("trainer")
    if report is None:
        return [CheckResult("kernels.job", Status.FAIL if ctx.needs_gpus else Status.WARN,
                            probe["crash"] or "not checked", "see the kernel probe's error")]
    if report["error"]:
        return [CheckResult("kernels.job", Status.FAIL if ctx.needs_gpus else Status.WARN,
                            f"{entrypoint}'s kernel selection failed: {report['error']}",
                            "install the project with its train extra in the job's environment")]
    if report["rows"] is None:
        return [CheckResult("kernels.job", Status.SKIP, f"{entrypoint} is not a bundled trainer: its kernels are its own")]
    results = []
    for row in report["rows"]:
        name = f"kernels.job.{TRAINER_ROWS.get(row['piece'], row['piece'])}"
        if row["ok"]:
            results.append(CheckResult(name, Status.PASS, f"[{device}] {row['chosen']}"))
            continue
        results.append(CheckResult(
            name, Status.FAIL if ctx.needs_gpus else Status.WARN,
            f"{row['missing']}; the trainer refuses to start (it would run {row['chosen']}: {row['cost']})",
            f"{row['install']} (or train with --allow-slow-path)"))
    return results


def _gdn_result(ctx: DoctorContext, probe: dict, fla_ok: bool) -> CheckResult:
    name = "kernels.gdn_fwd_bwd"
    if not ctx.has_cuda_gpus:
        return CheckResult(name, Status.SKIP, "no CUDA GPU visible")
    if not ctx.run_gdn:
        return CheckResult(name, Status.SKIP, "not run (fast subset; `launch doctor` runs it)")
    if not fla_ok:
        return CheckResult(name, Status.FAIL, "not run: fla does not import (see kernels.fla)", FLA_INSTALL)
    torch_facts = probe.get("torch", {})
    if not torch_facts.get("cuda_available"):
        found = torch_facts.get("error") or f"torch sees no CUDA device (torch CUDA build: {torch_facts.get('torch_cuda')})"
        return CheckResult(name, Status.FAIL, found, "install a CUDA build of torch that matches the driver")
    gdn = probe.get("gdn")
    if gdn is None:
        return CheckResult(name, Status.FAIL, probe["crash"] or "did not run", "see the kernel probe's error")
    if not gdn["ok"]:
        fix = "install tilelang (with z3-solver for libz3) or triton>=3.7.1" if "Hopper" in (gdn["error"] or "") else "see the error; check fla/triton versions"
        return CheckResult(name, Status.FAIL, gdn["error"], fix)
    worst_name, worst_err = max(gdn["errors"].items(), key=lambda kv: kv[1])
    summary = f"2 packed docs, max rel. RMS error {worst_err:.2e} ({worst_name}) vs float32 reference"
    if worst_err > GDN_TOLERANCE:
        return CheckResult(name, Status.FAIL, summary + f" > {GDN_TOLERANCE}", "fla gives wrong results with this triton/fla; upgrade or pin known-good versions")
    return CheckResult(name, Status.PASS, summary)


def _hopper_result(ctx: DoctorContext, probe: dict, triton_bad: str | None) -> CheckResult:
    name = "kernels.hopper_triton"
    if not ctx.has_cuda_gpus:
        return CheckResult(name, Status.SKIP, "no CUDA GPU visible")
    if not is_hopper(ctx, probe):
        return CheckResult(name, Status.SKIP, "not a Hopper GPU")
    if triton_bad is None:
        return CheckResult(name, Status.PASS, f"Hopper with triton {dist_version('triton')}")
    tilelang = probe["imports"].get("tilelang")
    if tilelang and tilelang["ok"]:
        return CheckResult(name, Status.PASS, f"Hopper, triton {triton_bad}: fla uses tilelang {dist_version('tilelang')}")
    if tilelang is None:
        why = probe["crash"] or "not checked"
    else:
        why = "not installed" if tilelang["not_installed"] else tilelang["error"]
    return CheckResult(
        name, Status.FAIL,
        f"Hopper with triton {triton_bad} (>=3.4,<3.7.1) gives wrong fla gated backward; tilelang: {why}",
        "pip install 'triton>=3.7.1', or tilelang (+ z3-solver, LD_LIBRARY_PATH to its libz3.so.4.15)",
    )


def _transformers_results(cc_ok: bool) -> list[CheckResult]:
    name = "kernels.transformers"
    text = dist_version("transformers")
    v = _version(text)
    if v is None:
        return [CheckResult(name, Status.SKIP, "transformers not installed")]
    if v < TRANSFORMERS_MIN_PACKING:
        return [CheckResult(
            name, Status.FAIL, f"transformers {text} < {TRANSFORMERS_MIN_PACKING}: no Qwen3.5 packed-sequence support",
            f"pip install 'transformers>={TRANSFORMERS_MIN_PACKING}'",
        )]
    if v < TRANSFORMERS_REFUSES_UNSAFE_PACKING and not cc_ok:
        return [CheckResult(
            name, Status.WARN,
            f"transformers {text}: without causal-conv1d its torch conv may mix packed documents silently (seen on 5.17)",
            "train through the project's varlen adapters, or install causal-conv1d / transformers>=5.23",
        )]
    return [CheckResult(name, Status.PASS, f"transformers {text}")]

