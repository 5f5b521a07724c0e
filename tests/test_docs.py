"""The READMEs say what the project has: every `make X` they show is a target of the Makefile,
every GPU figure README.md quotes is one bench/RESULTS.md records, and the test-time claims are
the ones tests/README.md measured. A stale sentence fails here, not in a newcomer's terminal."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "ansible/README.md", "train/README.md", "train/dflash/README.md", "images/README.md",
        "tests/README.md"]


def make_targets() -> set[str]:
    text = "\n".join(p.read_text() for p in [REPO / "Makefile", *sorted((REPO / "mk").glob("*.mk"))])
    return set(re.findall(r"^([a-zA-Z0-9_-]+):(?!=)", text, re.M))


def test_every_make_command_in_the_docs_is_a_target():
    targets = make_targets()
    missing = {}
    for doc in DOCS:
        path = REPO / doc
        if not path.exists():
            continue
        for target in re.findall(r"(?:`|^\s*)make ([a-z][a-z0-9_-]*)", path.read_text(), re.M):
            if target not in targets:
                missing.setdefault(doc, set()).add(target)
    assert not missing, f"`make X` in the docs with no such target: {missing}"


def _figures(text: str) -> set[str]:
    """The measured figures a sentence quotes: MFU percentages and tok/s."""
    return set(re.findall(r"(\d+(?:\.\d+)?)% (?:MFU|uMFU|useful-token MFU)", text)) \
        | {f"{m}k tok/s" for m in re.findall(r"(\d+(?:\.\d+)?)k tok/s", text)}


def test_the_readmes_gpu_figures_are_recorded_in_bench_results():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "bench" / "RESULTS.md").read_text()
    recorded = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", results.replace(",", ""))]
    quoted = _figures(readme)
    assert quoted, "README.md quotes no GPU figure: the check below would hold vacuously"

    def found(figure: str) -> bool:
        if figure.endswith("k tok/s"):  # 39.3k: a tok/s that rounds to it
            value = float(figure.split("k ")[0])
            return any(abs(n / 1000 - value) < 0.05 + 1e-9 for n in recorded)
        return float(figure) in recorded

    missing = sorted(f for f in quoted if not found(f))
    assert not missing, f"README.md quotes figures bench/RESULTS.md does not record: {missing}"


def test_the_test_time_claims_match_the_measured_ones():
    """README.md's `make test` and `make test-fast` times are the figures tests/README.md measured."""
    readme = (REPO / "README.md").read_text()
    measured = (REPO / "tests" / "README.md").read_text()
    claims = re.findall(r"make (test(?:-fast)?)\s+#[^\n]*?(\d+) min", readme)
    assert {name for name, _ in claims} == {"test", "test-fast"}, claims
    for name, minutes in claims:
        line = next((ln for ln in measured.splitlines() if ln.startswith(f"| `make {name}`")), None)
        assert line is not None, f"tests/README.md has no measured row for `make {name}`"
        assert re.search(rf"\b{minutes} min\b", line), f"README.md says `make {name}` takes {minutes} min; " \
                                                      f"tests/README.md measured: {line}"


def test_every_stall_cause_the_profiler_names_is_in_the_step_line_legends():
    """`STALL(cause)`: each cause stall_cause can return is explained in the legend the trainers
    print (`# step line: ...`), `unknown` included."""
    import inspect

    from toolkit.metrics import DFLASH_LEGEND
    from train.common.profiler import stall_cause
    from train.stage1.train import STEP_LINE_LEGEND

    source = inspect.getsource(stall_cause)
    causes = set(re.findall(r'causes\.append\("(\w+)"\)', source)) | set(re.findall(r'or "(\w+)"', source))
    assert {"compile", "unknown"} <= causes, causes
    assert all(c in STEP_LINE_LEGEND for c in causes), (causes, STEP_LINE_LEGEND)
    assert all(c in DFLASH_LEGEND for c in causes - {"images"}), (causes, DFLASH_LEGEND)


def test_the_step_lines_in_the_docs_are_the_trainers():
    """train/README.md's example step lines have the shape of the line the trainer prints."""
    from toolkit.metrics import SCHEMAS, compact_step_line

    record = {"step": 12, "steps_total": 60, "loss": 4.123, "task_loss": {"und": 4.0, "gen_img": 4.12},
              "tok_s": 33100.0, "mfu_useful": 0.501, "compute_ms": 950.0, "data_ms": 3.0, "peak_mem_mb": 98406.0,
              "eta_s": 31.0}
    printed = compact_step_line(SCHEMAS["stage1"], record, tuple(t for t, _ in SCHEMAS["stage1"].task_labels))
    shape = re.compile(r"^step \d+/\d+ loss [\d.]+ \((?:\w\w (?:[\d.]+|-) ?)+\) [\d.]+k? tok/s uMFU (?:[\d.]+%|n/a) "
                       r"\d+\+\d+ms [\d.]+G eta \w+$")
    assert shape.match(printed), printed
    examples = re.findall(r"`(step \d+[^`]*)`", (REPO / "train" / "README.md").read_text())
    assert examples
    assert all(shape.match(e) for e in examples), [e for e in examples if not shape.match(e)]
