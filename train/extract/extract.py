"""Hidden-state extraction: the frozen target model's captured layers, to batched safetensors shards.

`python -m train.extract --preset tiny` runs behind the Slurm guard; `main(argv, guard=False)`
exists only for tests. The target's forward goes through the base model (`model.model`): lm_head
is never called, so no full-vocab logits exist (248k vocab x 64k tokens was ~30 GB per GPU in the
reference run). Hidden states are captured by forward hooks on the chosen decoder layers only.

Batches are planned once from the dataset's lengths (sorted by length, cut under a token
budget: extraction has no convergence to protect, so it pads least), and shard k always holds plan
batch k; ranks take k = rank, rank + world, ... A re-run with the same arguments resumes: complete
shards are skipped, a shard left un-indexed by a crash is verified and adopted, tmp files are
removed. See train/extract/shards.py for the layout.

Each batch runs through the target packed: its samples' real tokens as one varlen stream (the
varlen attention and the packed GDN kernels keep the samples apart; positions restart per
sample), so no padding is computed; each sample's rows are sliced off the stream for its shard.
On CUDA the target's layer regions are compiled with dynamic sizes (--compile auto).

`--sync-cmd 'cp {src} /store/{name}'` copies each finished shard elsewhere; with
`--sync-check-cmd 'sha256sum /store/{name}'` (first field: the copy's sha256) the local file is
deleted once the copy's hash matches. Without a check command nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolkit.fsutil import atomic_write_bytes, atomic_write_text, sha256_file
from toolkit.metrics import SCHEMAS
from train.common.config import ConfigError
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.runtime import Runtime
from train.extract.args import DTYPE_NAMES, ExtractConfig, parse_args  # noqa: F401 - the flags live there (no torch)
from train.extract.data import DatasetError, TokenData, generate_synthetic, load_records, load_tokenizer
from train.extract.shards import (
    HEAD,
    META,
    ShardEntry,
    ShardError,
    bytes_per_token,
    check_disk,
    extraction_id,
    load_meta,
    nonfinite,
    read_index,
    remove_tmp_files,
    shard_header,
    shard_name,
    verify_shard,
    write_index,
    write_shard,
)
from train.extract.target import Target, TargetError, head_weights, load_target

ENTRYPOINT = "train.extract"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def default_layers(num_layers: int, n: int) -> list[int]:
    """n layers spread evenly over [1, L-3] (64 layers, n=5: 1, 16, 31, 46, 61)."""
    hi = max(1, num_layers - 3)
    return sorted({int(round(x)) for x in np.linspace(1, hi, n)})


def parse_layers(text: str | None, num_layers: int, n: int) -> list[int]:
    if not text:
        return default_layers(num_layers, n)
    try:
        given = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated integers, got {text!r}") from None
    twice = sorted({i for i in given if given.count(i) > 1})
    if twice:
        raise ConfigError(f"--layers {text!r}: layer {', '.join(map(str, twice))} given twice")
    layers = sorted(given)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if not layers or bad:
        raise ConfigError(f"--layers {text!r}: indices must lie in [0, {num_layers - 1}] for this target")
    return layers


def plan_batches(lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    from train.common.bucketing import sorted_batches

    return [sorted(int(i) for i in b) for b in sorted_batches(lengths, token_budget)]


class HiddenCapture:
    """Forward hooks on the chosen decoder layers: their outputs, and nothing else, are kept."""

    def __init__(self, base_model: torch.nn.Module, layers: list[int]) -> None:
        self.layers = layers
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [base_model.layers[i].register_forward_hook(self._hook(i)) for i in layers]

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> torch.Tensor:
        """[B, T, n_layers * hidden], captured layers concatenated in layer order."""
        out = torch.cat([self.outputs[i] for i in self.layers], dim=-1)
        self.outputs.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def target_forward(base_model: torch.nn.Module, capture: HiddenCapture, input_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(captured hidden [B,T,n*H], final normed hidden [B,T,H]) from the base model: no lm_head.

    Rows are right-padded; every token mixer is causal, so real tokens never see the padding.
    """
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    with torch.no_grad():
        final = base_model(input_ids=input_ids, position_ids=pos, use_cache=False).last_hidden_state
    return capture.take(), final


def pack_batch(samples: list[np.ndarray]) -> tuple[torch.Tensor, list[int], dict[str, torch.Tensor | int]]:
    """The batch as one flat varlen stream: ids [1, N] (N = the real tokens, no padding), the
    lengths, and the packing keywords the target takes (positions restarting at every sample,
    cu_seqlens for the varlen attention and the GDN kernels, the samples' index per token)."""
    lengths = [len(s) for s in samples]
    ids = torch.from_numpy(np.concatenate(samples).astype(np.int64))[None]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    return ids, lengths, {"position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "seq_idx": seq_idx,
                          "max_length_q": max(lengths), "max_length_k": max(lengths)}


def target_forward_packed(base_model: torch.nn.Module, capture: HiddenCapture, ids: torch.Tensor,
                          packing: dict[str, torch.Tensor | int]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_forward over a pack_batch stream: (captured [1, N, n*H], final [1, N, H]); sample r
    is rows cu[r]:cu[r+1]. Needs the varlen attention (use_attention(model, "varlen")) and the
    packed GDN layers (fastpath.install_kernels): each sample sees only itself."""
    dev = ids.device
    kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in packing.items()}
    with torch.no_grad():
        final = base_model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
    return capture.take(), final


def pad_batch(samples: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in samples]
    ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s)] = torch.from_numpy(s)
    return ids, lengths


def _run_shell(template: str, **fields: str) -> subprocess.CompletedProcess[str]:
    cmd = template.format(**{k: shlex.quote(v) for k, v in fields.items()})
    return subprocess.run(cmd, shell=True, capture_output=True, text=True)


def sync_shard(cfg: ExtractConfig, path: Path, entry: ShardEntry) -> str:
    """Copy a finished shard with --sync-cmd; delete it locally only if --sync-check-cmd confirms it."""
    assert cfg.sync_cmd
    done = _run_shell(cfg.sync_cmd, src=str(path), name=path.name)
    if done.returncode != 0:
        raise ShardError(f"--sync-cmd failed for {path} (exit {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or [''])[-1]}); the local shard is kept")
    if not cfg.sync_check_cmd:
        return "local"
    check = _run_shell(cfg.sync_check_cmd, name=path.name)
    remote = (check.stdout.split() or [""])[0]
    if check.returncode != 0 or remote != entry.sha256:
        raise ShardError(f"synced copy of {path.name} does not verify (sha256 {remote or 'unreadable'} != "
                         f"{entry.sha256}); the local shard is kept")
    path.unlink()
    return "synced"


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=extract, guard=guard,
                          run_errors=(DatasetError, ShardError, FastPathError, TargetError, ValueError))


@dataclass
class Extraction:
    cfg: ExtractConfig
    base: torch.nn.Module
    capture: HiddenCapture
    samples: list[np.ndarray]
    loss_masks: list[np.ndarray]
    lengths: np.ndarray
    plan: list[list[int]]
    mine: dict[str, ShardEntry]  # this rank's index
    ident: str  # the extraction's identity, in every shard's metadata (shards.extraction_id)
    t0: float = field(default_factory=time.perf_counter)
    written: int = 0
    skipped: int = 0
    done_samples: int = 0
    done_tokens: int = 0
    # the index (mine) is written by the shard writer's thread and by already_done in the main one
    lock: threading.RLock = field(default_factory=threading.RLock)


def extract(cfg: ExtractConfig) -> int:
    """setup -> one shard per plan batch of this rank (skipped when already whole) -> finish."""
    with Runtime.start(ENTRYPOINT, SCHEMAS["extract"], cfg.out, tensorboard=False) as rt:
        job = setup(cfg, rt)
        writer = ShardWriter(cfg.overlap == "on" or (cfg.overlap == "auto" and rt.device.type == "cuda"))
        started = 0
        try:
            for k, batch in enumerate(job.plan):
                if k % rt.dist.world_size != rt.dist.rank or already_done(job, rt, k, batch):
                    continue
                if cfg.stop_after is not None and started >= cfg.stop_after:
                    break
                write_one(job, rt, k, batch, writer)
                started += 1
        finally:
            writer.close()
        finish(job, rt)
    return 0


def setup(cfg: ExtractConfig, rt: Runtime) -> Extraction:
    """The frozen target (no lm_head call), the dataset and its batch plan, meta.json, the index."""
    from safetensors.torch import save

    from train.common import fastpath, varlen_attention
    from train.common.regional_compile import apply_regional_compile, compile_enabled

    out, dist_info = rt.out, rt.dist
    out.mkdir(parents=True, exist_ok=True)
    kernels = fastpath.select_kernels(rt.device, allow_slow_path=cfg.allow_slow_path)
    target = load_target(cfg.init_from, cfg.preset, rt.device, cfg.target_dtype, cfg.seed)
    fastpath.install_kernels(target.base, kernels)
    varlen_attention.use_attention(target.base, "varlen")  # batches run packed (write_one)
    if compile_enabled(cfg.compile, rt.device):
        apply_regional_compile(target.base, dynamic=True)  # the packed stream's length changes every batch
    text = target.config
    layers = parse_layers(cfg.layers, text.num_hidden_layers, cfg.n_layers)

    data_path = Path(cfg.data) if cfg.data else out / "data.jsonl"
    if not cfg.data:
        if dist_info.is_main and not data_path.exists():
            generate_synthetic(data_path, cfg.synthetic_samples, seed=cfg.seed, vocab=target.vocab_size)
        rt.barrier()  # every rank reads the file rank 0 wrote
    records = load_token_data(cfg, data_path, target.vocab_size)
    samples = records.ids
    if records.truncated:
        rt.print(records.report(cfg.max_len))
    lengths = np.array([len(s) for s in samples])
    plan = plan_batches(lengths, cfg.token_budget)
    # Before anything is written: the estimate, and a refusal when the filesystem lacks the space.
    check_disk(out, disk_needed(out, plan, lengths, len(layers), target, cfg), rt.print)
    meta = {
        "preset": cfg.preset, "init_from": cfg.init_from, "layers": layers, "hidden_size": text.hidden_size,
        "vocab_size": target.vocab_size, "target": target.source, "target_config_sha256": target.config_sha256,
        "tokenizer": cfg.tokenizer or cfg.init_from,
        "dtype": cfg.dtype, "data": str(data_path.resolve()),
        "samples": len(samples), "shards": len(plan), "token_budget": cfg.token_budget, "seed": cfg.seed,
        "plan_sha256": hashlib.sha256(json.dumps(plan).encode()).hexdigest(),
        "truncated": records.truncated, "target_config": target_config(text),
    }
    old = load_meta(out / META, ("preset", "layers", "samples", "plan_sha256")) if (out / META).exists() else None
    if old is not None:
        changed = [k for k in ("preset", "layers", "samples", "plan_sha256", "dtype", "init_from") if old.get(k) != meta[k]]
        if changed:
            raise ConfigError(f"{out}: holds an extraction with different {', '.join(changed)}; "
                              "use a new --out or the same arguments as before")
    elif dist_info.is_main:
        # The head first, then meta.json: a directory with a meta.json always has its head.
        embed, lm_head = head_weights(target)  # lm_head read from the files: the base model has none
        head = {"embed_tokens": embed.contiguous(), "lm_head": lm_head.contiguous()}
        atomic_write_bytes(out / HEAD, save(head))
        atomic_write_text(out / META, json.dumps(meta, indent=1) + "\n")

    ident = extraction_id(old or meta)  # a resume keeps the identity its shards were written with
    if dist_info.is_main:
        for tmp in remove_tmp_files(out):
            rt.print(f"# removed {tmp.name}: a write cut short by an earlier crash")
    index = read_index(out)
    mine = {name: e for name, e in index.items() if int(name[6:11]) % dist_info.world_size == dist_info.rank}
    # Every rank has read the merged index, and rank 0's tmp cleanup is over, before any rank
    # rewrites its own index or starts a shard (a resume may use a different world size).
    if dist_info.world_size > 1:
        rt.barrier()
    write_index(out, dist_info.rank, mine)
    rt.log.header({"preset": cfg.preset, "layers": layers, "samples": len(samples), "shards": len(plan),
                   "world": dist_info.world_size, "device": rt.device.type, "lm_head": "never called"})
    return Extraction(cfg, target.base, HiddenCapture(target.base, layers), samples, records.loss_masks, lengths,
                      plan, mine, ident)


def already_done(job: Extraction, rt: Runtime, k: int, batch: list[int]) -> bool:
    """A shard of an earlier run: whole and indexed (synced now if asked), or whole but not yet
    indexed (a crash after its rename: adopted)."""
    with job.lock:
        return _already_done(job, rt, k, batch)


def _already_done(job: Extraction, rt: Runtime, k: int, batch: list[int]) -> bool:
    name, path = shard_name(k), rt.out / shard_name(k)
    entry = job.mine.get(name)
    if entry is not None and (entry.location == "synced" or _whole(path, entry, rt.print)):
        if entry.location == "local" and job.cfg.sync_cmd:
            entry.location = sync_shard(job.cfg, path, entry)
            write_index(rt.out, rt.dist.rank, job.mine)
        job.skipped += 1
        return True
    if entry is None and path.exists() and _adoptable(path, batch, job.ident, rt.print):
        job.mine[name] = ShardEntry(batch, [int(job.lengths[i]) for i in batch], path.stat().st_size,
                                    sha256_file(path))
        write_index(rt.out, rt.dist.rank, job.mine)
        rt.print(f"# adopted {name}: whole but not yet indexed (crash after its rename)")
        job.skipped += 1
        return True
    return False


class ShardWriter:
    """Shard writes off the critical path: one background thread persists shard k (waits for its
    device-to-host copies, checks, writes, indexes, syncs, logs) while the main thread runs the
    next batch through the target. One write in flight: shards and index updates keep their order,
    at most two batches' states are held, and a write's failure is raised in the main thread at
    the next submit or at close. Off: each write runs inline, as before."""

    def __init__(self, overlap: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer") if overlap else None
        self.pending = None

    def submit(self, fn) -> None:
        if self.pool is None:
            fn()
            return
        self.wait()
        self.pending = self.pool.submit(fn)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream per GPU for device-to-host copies: on the compute stream a copy would run
    before the next batch's kernels, on its own it runs beside them."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory; from a GPU, into pinned memory on the copy stream without blocking
    (wait on an event recorded there)."""
    if t.device.type != "cuda":
        return t.cpu()
    stream = copy_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        out.copy_(t, non_blocking=True)
    t.record_stream(stream)  # its memory is not reused before the copy is done
    return out


def write_one(job: Extraction, rt: Runtime, k: int, batch: list[int], writer: ShardWriter | None = None) -> None:
    """Plan batch k through the target; its shard written, indexed, and synced if asked (by
    `writer`'s thread while the next batch runs, or here)."""
    name, path = shard_name(k), rt.out / shard_name(k)
    # packed: the forward runs the batch's real tokens only, as one varlen stream
    ids, lens, packing = pack_batch([job.samples[i] for i in batch])
    hidden, final = target_forward_packed(job.base, job.capture, ids.to(rt.device), packing)
    store = DTYPES[job.cfg.dtype]
    starts = np.concatenate([[0], np.cumsum(lens)])
    rows = [(to_host(hidden[0, lo:lo + n].to(store)), to_host(final[0, lo:lo + n].to(store)))
            for lo, n in zip(starts.tolist(), lens, strict=False)]
    ids = [ids[0, lo:lo + n] for lo, n in zip(starts.tolist(), lens, strict=False)]
    copied = None
    if hidden.device.type == "cuda":
        copied = torch.cuda.Event()
        copied.record(copy_stream(hidden.device))
    del hidden, final  # the copies hold what they need; the device memory goes back for the next batch

    def persist() -> None:
        if copied is not None:
            copied.synchronize()
        tensors = {
            idx: {"input_ids": ids[r].to(torch.int32), "loss_mask": torch.from_numpy(job.loss_masks[idx]),
                  "hidden": rows[r][0], "final": rows[r][1]}
            for r, idx in enumerate(batch)
        }
        finish_shard(job, rt, k, batch, lens, name, path, tensors)

    (writer or ShardWriter(False)).submit(persist)


def finish_shard(job: Extraction, rt: Runtime, k: int, batch: list[int], lens: list[int], name: str, path: Path,
                 tensors: dict[int, dict[str, torch.Tensor]]) -> None:
    refuse_nonfinite(name, tensors)
    size, digest = write_shard(path, tensors, metadata={"samples": ",".join(map(str, batch)),
                                                                "extraction": job.ident})
    entry = ShardEntry(batch, lens, size, digest)
    with job.lock:
        job.mine[name] = entry
        write_index(rt.out, rt.dist.rank, job.mine)
    if job.cfg.sync_cmd:
        entry.location = sync_shard(job.cfg, path, entry)
        with job.lock:
            write_index(rt.out, rt.dist.rank, job.mine)
    job.written += 1
    job.done_samples += len(batch)
    job.done_tokens += sum(lens)
    rt.step = k + 1
    dt = time.perf_counter() - job.t0
    rt.log.log_step({"step": k + 1, "shards": len(job.plan), "samples": len(batch),
                     "samples_per_s": job.done_samples / dt, "tok_s": job.done_tokens / dt,
                     "mib": entry.bytes / 2**20, "location": entry.location})


def finish(job: Extraction, rt: Runtime) -> None:
    job.capture.remove()
    written, skipped, done_samples = job.written, job.skipped, job.done_samples
    if rt.dist.world_size > 1:
        counts = torch.tensor([written, skipped, done_samples], dtype=torch.long)
        torch.distributed.all_reduce(counts)  # also the barrier before the completeness check
        written, skipped, done_samples = counts.tolist()
    complete = len(read_index(rt.out)) == len(job.plan)
    summary = {"shards": len(job.plan), "written": written, "skipped": skipped, "complete": complete,
               "samples_per_s": done_samples / max(1e-9, time.perf_counter() - job.t0), "out": str(rt.out.resolve())}
    if complete:
        rt.finish(summary)
    else:
        rt.print(f"# done: {json.dumps(summary)}")


def _whole(path: Path, entry: ShardEntry, say=print) -> bool:
    """An indexed local shard still there with the size and sha256 it was written with (else it is
    rewritten: a same-size bit flip shows only in the hash)."""
    reason = verify_shard(path, entry)
    if reason is not None and path.exists():
        say(f"# rewriting {path.name}: {reason}")
    return reason is None


def _adoptable(path: Path, batch: list[int], ident: str, say=print) -> bool:
    """A whole shard of this extraction holding exactly this batch's samples (else it is rewritten)."""
    try:
        keys, metadata = shard_header(path)
    except ShardError:
        return False
    if metadata.get("extraction", ident) != ident:
        say(f"# rewriting {path.name}: written by another extraction (id {metadata['extraction']}, this one's {ident})")
        return False
    per_sample: dict[int, set[str]] = {}
    for k in keys:
        idx, _, name = k.partition(".")
        per_sample.setdefault(int(idx), set()).add(name)
    return sorted(per_sample) == sorted(batch) and all(v == set(SAMPLE_KEYS) for v in per_sample.values())


SAMPLE_KEYS = ("input_ids", "loss_mask", "hidden", "final")


def load_token_data(cfg: ExtractConfig, data_path: Path, vocab: int) -> TokenData:
    """The dataset with its loss masks; the target's tokenizer is loaded only if the file has conversations."""
    tokenizer_dir = cfg.tokenizer or cfg.init_from
    try:
        return load_records(data_path, vocab=vocab, max_len=cfg.max_len)
    except DatasetError as exc:
        if "needs the target's tokenizer" not in str(exc) or not tokenizer_dir:
            raise
    return load_records(data_path, vocab=vocab, max_len=cfg.max_len, tokenizer=load_tokenizer(tokenizer_dir, "--tokenizer" if cfg.tokenizer else "--init-from"))


def target_config(text_config) -> dict:
    """The target's text config fields the drafter is shaped by (train.dflash.model.TargetShape)."""
    from train.dflash.model import TargetShape

    return asdict(TargetShape.from_config(text_config))


def disk_needed(out: Path, plan: list[list[int]], lengths: np.ndarray, n_layers: int, target: Target,
                cfg: ExtractConfig) -> int:
    """Bytes still to write under `out`: bytes/token x tokens of the shards not yet indexed (with a
    verified sync, shards are deleted once copied: only the largest is here at a time), plus the
    target head if it is not there yet."""
    done = read_index(out) if out.is_dir() else {}
    per_token = bytes_per_token(n_layers, target.config.hidden_size, cfg.dtype)
    sizes = [per_token * int(lengths[b].sum()) for k, b in enumerate(plan) if shard_name(k) not in done]
    need = (max(sizes) if cfg.sync_check_cmd else sum(sizes)) if sizes else 0
    if not (out / HEAD).exists():
        need += 2 * target.base.embed_tokens.weight.numel() * target.base.embed_tokens.weight.element_size()
    return need


def refuse_nonfinite(name: str, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
    bad = [f"{i}.{k}" for i, t in tensors.items() for k in nonfinite(t)]
    if bad:
        raise ShardError(f"{name}: the target produced non-finite hidden states ({', '.join(bad[:3])}); "
                         "nothing written (check --init-from and the dtype)")


__all__ = ["ExtractConfig", "extract", "main"]
