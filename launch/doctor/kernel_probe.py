"""Imports the training kernels in a fresh interpreter and reports what really happened.

Run by kernels.py as `python -c <this file's source> --out FILE [--tilelang] [--gdn] [--trainer
ENTRYPOINT]`, in a
child process so that a broken extension (an import that segfaults, a half-imported package)
cannot take the doctor down, and so the import state is exactly what a fresh trainer sees.
Standard library only at top level: torch is imported only when a kernel needs it.

transformers wraps these same imports in `except Exception` and then logs that the package
"is not installed"; here the exception itself is kept: type, message and where it was raised.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback


def try_import(module: str, attr: str | None = None) -> dict:
    try:
        mod = importlib.import_module(module)
        if attr is not None:
            getattr(mod, attr)
        return {"ok": True, "error": None, "not_installed": False}
    except (Exception, SystemExit) as exc:
        top = module.split(".")[0]
        not_installed = isinstance(exc, ModuleNotFoundError) and exc.name == top
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames and not not_installed else ""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"ok": False, "error": f"{type(exc).__name__}: {message}{where}", "not_installed": not_installed}


def torch_facts() -> dict:
    import torch

    facts: dict = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if facts["cuda_available"]:
        facts["device_count"] = torch.cuda.device_count()
        facts["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(facts["device_count"])]
        facts["device_name"] = torch.cuda.get_device_name(0)
    return facts


def reference_gdn(q, k, v, g, beta, scale: float):
    """Gated delta rule, one token at a time, in float32: the oracle for fla's chunked kernel.

    Per head, with state S (K x V): S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = scale * S^T q_t. Shapes [T, H, *] for one document.
    """
    import torch

    T, H, K = q.shape
    state = q.new_zeros(H, K, v.shape[-1])
    outs = []
    for t in range(T):
        state = state * torch.exp(g[t])[:, None, None]
        kt, vt = k[t], v[t]
        predicted = torch.einsum("hk,hkv->hv", kt, state)
        state = state + torch.einsum("hk,hv->hkv", kt * beta[t][:, None], vt - predicted)
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, state))
    return torch.stack(outs)


def gdn_check() -> dict:
    """Two packed documents through fla's chunk_gated_delta_rule, forward and backward, against
    the reference run on each document alone. Relative RMS error per tensor."""
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    torch.manual_seed(0)
    dev = "cuda"
    T, H, K, V, split = 160, 2, 64, 64, 67
    scale = K**-0.5
    base = {
        "q": torch.randn(1, T, H, K),
        "k": F.normalize(torch.randn(1, T, H, K), dim=-1),
        "v": torch.randn(1, T, H, V),
        "g": F.logsigmoid(torch.randn(1, T, H)),
        "beta": torch.rand(1, T, H),
    }
    fast = {n: t.to(dev, torch.bfloat16).requires_grad_() for n, t in base.items()}
    ref = {n: fast[n].detach().float().requires_grad_() for n in base}
    cu_seqlens = torch.tensor([0, split, T], dtype=torch.long, device=dev)
    out, _ = chunk_gated_delta_rule(
        fast["q"], fast["k"], fast["v"], fast["g"], fast["beta"], scale=scale, cu_seqlens=cu_seqlens
    )
    grad_out = torch.randn_like(out, dtype=torch.float32)
    (out.float() * grad_out).sum().backward()
    ref_out = torch.cat([
        reference_gdn(*(ref[n][0, a:b] for n in ("q", "k", "v", "g", "beta")), scale=scale)
        for a, b in ((0, split), (split, T))
    ])[None]
    (ref_out * grad_out).sum().backward()

    def rel(a, b) -> float:
        return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12))

    errors = {"out": rel(out, ref_out), **{f"d{n}": rel(fast[n].grad, ref[n].grad) for n in base}}
    return {"ok": True, "errors": errors, "error": None}


def trainer_rows(entrypoint: str, device: str, choices: dict) -> dict:
    """The trainer's own kernel selection (train.common.fastpath.kernel_rows: the same imports and
    probes it makes at start), one row per kernel of the job's set."""
    try:
        from train.common import fastpath

        return {"rows": fastpath.kernel_rows(entrypoint, device, choices=choices), "error": None}
    except (Exception, SystemExit) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"rows": None, "error": f"{type(exc).__name__}: {msg}"}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tilelang", action="store_true")
    parser.add_argument("--gdn", action="store_true")
    parser.add_argument("--torch", action="store_true", help="report torch's CUDA facts")
    parser.add_argument("--trainer", help="the job's entrypoint: its kernel set through the trainer's own selection")
    parser.add_argument("--device", default="cuda", help="with --trainer: the device type whose policy applies")
    parser.add_argument("--choices", default="{}", help="with --trainer: the job's kernel arguments, JSON")
    args = parser.parse_args()

    report: dict = {"imports": {}}
    imports = report["imports"]

    def save() -> None:
        # Written after every step: if a later step crashes the interpreter, what came before survives.
        # (beside, then renamed: a probe killed mid-write leaves the last whole report)
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.out + ".tmp", args.out)

    def probe(key: str, module: str, attr: str | None = None) -> None:
        # What is being imported is saved first: an import that ends the interpreter (os._exit,
        # a segfault, sys.exit in an atexit-less path) leaves it named for the doctor's rows.
        report["importing"] = module
        save()
        imports[key] = try_import(module, attr)
        report.pop("importing")
        save()

    probe("fla", "fla")
    if imports["fla"]["ok"]:
        probe("fla.gated_delta_rule", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
        probe("fla.causal_conv1d", "fla.modules.convolution", "causal_conv1d")
    probe("causal_conv1d", "causal_conv1d", "causal_conv1d_fn")
    if args.tilelang:
        probe("tilelang", "tilelang")
    if args.torch or "torch" in sys.modules:
        try:
            report["torch"] = torch_facts()
        except Exception as exc:
            report["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    if args.trainer:
        report["trainer"] = trainer_rows(args.trainer, args.device, json.loads(args.choices))
        save()
    gdn_ready = imports.get("fla.gated_delta_rule", {}).get("ok") and report.get("torch", {}).get("cuda_available")
    if args.gdn and gdn_ready:
        try:
            report["gdn"] = gdn_check()
        except Exception as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            report["gdn"] = {"ok": False, "errors": None, "error": f"{type(exc).__name__}: {msg}"}
        save()

    report["done"] = True
    save()


if __name__ == "__main__":
    main()
