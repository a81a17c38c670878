"""The reports of scripts/gpu_check.sh: tests.txt from pytest's junit xml, and the one-screen summary.txt.

    python -m benchmarks.gpu.check tests --junit J --log L --rc N --wall S --cap S --out OUT/tests.txt [--command C]
    python -m benchmarks.gpu.check summary OUT [--step NAME=SECONDS:STATUS ...] [--device D]

Both read only files, so the script calls `summary` after every step: a check killed at its time limit still
leaves a summary of the steps that finished. Everything here runs on a machine without torch's GPU build.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

FAILURES_SHOWN = 25
# pytest -q progress lines: one character per finished test, then the percentage
PROGRESS = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?\s*$")


def _test_id(classname: str, name: str) -> str:
    """tests.reuse.test_rope + name -> tests/reuse/test_rope.py::name (classes become ::Class)."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        module = os.path.join(*parts[:cut]) + ".py"
        if os.path.exists(module):
            return "::".join([module, *parts[cut:], name])
    return "::".join(p for p in (classname, name) if p) or "<collection>"


def _first_line(element) -> str:
    for text in (element.get("message") or "", element.text or ""):
        for line in text.splitlines():
            if line.strip():
                line = line.strip()
                return line if len(line) <= 150 else line[:147] + "..."
    return element.tag


def junit_counts(path: str) -> tuple[dict[str, int], list[tuple[str, str, str]]] | None:
    """({passed, failed, errors, skipped}, [(test id, failure|error, first line)]) of a junit xml; None if absent."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    bad = [(_test_id(case.get("classname", ""), case.get("name", "")), kind, _first_line(el))
           for case in root.iter("testcase") for kind in ("failure", "error") for el in case.findall(kind)]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"]}, bad


def progress_counts(log: str) -> dict[str, int]:
    """Counts from pytest -q's progress characters: for a run stopped before it wrote its junit xml."""
    chars = ""
    if os.path.exists(log):
        for line in Path(log).read_text(errors="replace").splitlines():
            m = PROGRESS.match(line.strip())
            if m:
                chars += m.group(1)
    return {"passed": chars.count("."), "failed": chars.count("F"), "errors": chars.count("E"),
            "skipped": chars.count("s") + chars.count("x") + chars.count("X")}


def junit_report(junit: str, log: str, rc: int, wall: float, cap: float, command: str = "") -> tuple[str, bool]:
    """(the text of tests.txt, whether the step passed). Its first line is the one the summary shows."""
    capped = rc in (124, 137) or (rc in (2, 130) and wall >= cap - 1)  # timeout's status, or pytest interrupted
    parsed = junit_counts(junit)
    source = "junit xml"
    if parsed is None:
        counts, bad, source = progress_counts(log), [], "pytest's progress line (no junit xml was written)"
    else:
        counts, bad = parsed
    head = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped in {wall:.0f} s")
    if capped:
        head += f" (stopped at its {cap:.0f} s cap: the tests that had not finished are not counted)"
    elif rc not in (0, 1):
        head += f" (pytest exit {rc})"
    lines = [f"tests: {head}", f"counted from: {source}"]
    if command:
        lines.append(f"command: {command}")
    for tid, kind, first in bad[:FAILURES_SHOWN]:
        lines.append(f"{'FAIL' if kind == 'failure' else 'ERROR'} {tid}\n     {first}")
    if len(bad) > FAILURES_SHOWN:
        lines.append(f"... and {len(bad) - FAILURES_SHOWN} more (tracebacks: failures.txt)")
    ok = rc == 0 and not bad and not capped and counts["passed"] > 0
    if not ok and os.path.exists(log):
        tail = Path(log).read_text(errors="replace").splitlines()[-15:]
        lines += ["-- last lines of the pytest log --", *tail]
    return "\n".join(lines) + "\n", ok


# ---------------------------------------------------------------------------------------------------- summary


def _f(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps_text(steps: dict) -> str:
    """fp32 argmax share per system, and KVBoost's duels with HF generate."""
    parts = [f"{name} {_pct(s['fp32_argmax'], s['steps'])}" for name, s in
             (("HF", steps.get("reference")), ("KVB", steps.get("kvboost")), ("recipe", steps.get("recipe"))) if s]
    text = "fp32-argmax steps " + ", ".join(parts) if parts else ""
    kvb = steps.get("kvboost") or {}
    if kvb.get("off_argmax"):
        text += f"; KVB off-argmax {kvb['off_argmax_near_tie']}/{kvb['off_argmax']} near-tie"
    if kvb.get("duels"):
        d = kvb["duels"]
        text += f"; duels KVB-HF {d['won']}-{d['lost']} ({d['near_tie']} near-tie)"
    return text


def fidelity_lines(section: dict) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for dtype, t in section.get("totals", {}).items():
        short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        q = t["questions"]
        text = f"identical KVB {t['kvboost_identical']}/{q}, recipe {t['recipe_identical']}/{q}"
        steps = _steps_text(t.get("fp32_steps", {}))
        rows.append((f"fidelity {short} (all)", text + (f" | {steps}" if steps else "")))
    bench = [r for r in section.get("rows", []) if r["model"] not in ("llama", "mistral")]
    for r in bench:  # the bench's own model (the real shape) on its own line
        short = {"bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
        q = r["questions"]
        steps = _steps_text(r.get("fp32_steps", {}))
        rows.append((f"  {r['model']} {short}", f"identical KVB {r['kvboost_identical']}/{q}, recipe "
                                               f"{r['recipe_identical']}/{q}" + (f" | {steps}" if steps else "")))
    if section.get("status") not in ("ok", None):
        rows.append(("  fidelity status", f"{section['status']}: {section.get('reason', '')}"))
    return rows


def decode_line(section: dict) -> str:
    rows = {(r["system"], r["batch"]): r for r in section.get("rows", [])}
    parts = []
    for system, label in (("kvboost", "KVB"), ("hf static+compile", "HF static+compile"), ("hf eager", "HF eager"),
                          ("hf static", "HF static")):
        r = rows.get((system, 1))
        if r is None:
            continue
        if r.get("status") == "ok":
            extra = f" (compile {_f(r.get('compile_s'), 0)} s)" if r.get("compile_s") is not None else ""
            parts.append(f"{label} {_f(r.get('decode_tok_s'))} tok/s{extra}")
        else:
            reason = str(r.get("reason", ""))
            parts.append(f"{label} {r.get('status')} ({reason[:77] + '...' if len(reason) > 80 else reason})")
    return " | ".join(parts) or "-"


def prefix_lines(section: dict) -> list[tuple[str, str]]:
    out = []
    for r in section.get("rows", []):
        host = _f(r.get("host_over_floor"), 2) if "host_over_floor" in r else ("error" if "host_error" in r else "-")
        out.append((f"prefix {r['prefix_tokens']:,} KVB/floor", f"resident {_f(r.get('kvboost_over_floor'), 2)}, "
                                                                f"from store {_f(r.get('store_over_floor'), 2)}, "
                                                                f"host tier {host} (floor {_f(r.get('floor_ms'))} ms)"))
    return out


def bench_lines(report: dict) -> list[tuple[str, str]]:
    sections = report.get("sections", {})
    lines: list[tuple[str, str]] = []
    if "fidelity" in sections:
        lines += fidelity_lines(sections["fidelity"])
    chat = sections.get("chat", {})
    if chat.get("from_turn2"):
        c = chat["from_turn2"]
        lines.append(("chat TTFT from turn 2", f"KVB p50 {_f(c['kvboost_p50_ms'])} ms, p99 {_f(c['kvboost_p99_ms'])} ms"
                                               f" | plain p50 {_f(c['plain_p50_ms'])} ms, manual p50 "
                                               f"{_f(c['manual_p50_ms'])} ms ({len(chat.get('samples', []))} turns)"))
    if "prefix" in sections:
        lines += prefix_lines(sections["prefix"])
    if "decode" in sections:
        lines.append(("decode batch 1", decode_line(sections["decode"])))
    state = ", ".join(f"{name} {s.get('status')} {_f(s.get('wall_s'), 0)}/{_f(s.get('budget_s'), 0)} s"
                      for name, s in sections.items())
    if state:
        lines.append(("bench sections", state + ("" if report.get("complete") else " (run did not finish)")))
    return lines


def offload_lines(report: dict | None) -> list[tuple[str, str]]:
    """`kvboost bench offload --device cuda`: tok/s and peak device MB of each row (or why it did not run)."""
    if not report:
        return []
    rows = []
    for r in report.get("rows", []):
        if r.get("status") == "ok":
            rows.append(f"{r['system']} {_f(r.get('decode_tok_s'))} tok/s, {_f(r.get('peak_device_mb'), 0)} MB")
        else:
            rows.append(f"{r['system']} {r.get('status')}: {r.get('reason', '')[:60]}")
    return [("offload (INT4)", " | ".join(rows) or "no rows")]


def summary_text(out: Path, steps: list[str], device: str = "") -> str:
    report = _load(out / "gpu.json") or {}
    machine = report.get("machine") or {}
    gpu = (machine.get("gpu") or {}).get("name") or machine.get("cuda") or machine.get("cpu") or "?"
    title = (f"kvboost GPU check on {device or report.get('device', '?')}: {gpu}, torch {machine.get('torch', '?')}, "
             f"transformers {machine.get('transformers', '?')}")
    if report.get("model"):
        title += f"; bench: {report['model']}, {report.get('dtype')}"
    lines: list[tuple[str, str]] = []
    tests = out / "tests.txt"
    if tests.exists():
        first = tests.read_text().splitlines()[:1]
        lines.append(("tests (gpu_smoke)", first[0].removeprefix("tests: ") if first else "-"))
    lines += bench_lines(report)
    lines += offload_lines(_load(out / "offload.json"))
    for extra, label in (("longctx.json", "longctx"), ("spec_gpu.json", "spec")):
        if (out / extra).exists():
            lines.append((label, f"see {extra}" if _load(out / extra) else f"{extra} unreadable"))
    if steps:
        lines.append(("steps", ", ".join(steps)))
    width = max((len(k) for k, _ in lines), default=0)
    return "\n".join([f"== {title}", *(f"{k:<{width}}  {v}" for k, v in lines)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tests", help="write tests.txt from a pytest run; exit 0 when every selected test passed")
    t.add_argument("--junit", required=True)
    t.add_argument("--log", required=True)
    t.add_argument("--rc", type=int, required=True)
    t.add_argument("--wall", type=float, required=True)
    t.add_argument("--cap", type=float, required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--command", default="")
    s = sub.add_parser("summary", help="write OUT/summary.txt from what OUT holds, and print it")
    s.add_argument("out")
    s.add_argument("--step", action="append", default=[], help="NAME=SECONDS:STATUS, in the order run")
    s.add_argument("--device", default="")
    args = parser.parse_args(argv)
    if args.what == "tests":
        text, ok = junit_report(args.junit, args.log, args.rc, args.wall, args.cap, args.command)
        Path(args.out).write_text(text)
        print(text, end="")
        return 0 if ok else 1
    out = Path(args.out)
    steps = []
    for name, _, rest in (s.partition("=") for s in args.step):
        seconds, _, state = rest.partition(":")
        steps.append(f"{name} {seconds} s ({state})" if state else f"{name} {seconds} s")
    text = summary_text(out, steps, args.device)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
