"""Text for people: a probe's result, the model registry. Units are converted only here."""

from __future__ import annotations

from typing import Any

from autotune.config import format_bytes
from autotune.result import PHASES, ProbeResult


def format_probe_result(result: ProbeResult, model: str) -> str:
    """A short readable summary of one probe: status, speed, per-phase time and memory."""
    device = result.device_name or "unknown device"
    lines = [f"probe {model} on {device}: {result.status.value}"]
    if not result.ok:
        where = f" (in {result.failed_phase})" if result.failed_phase else ""
        lines.append(f"  {result.message}{where}")
    if result.tokens_per_s is not None:
        lines.append(f"  tokens/s {result.tokens_per_s:,.1f}   samples/s "
                     f"{result.samples_per_s:,.2f}   step {result.step_s:.2f} s "
                     "(per device, validation excluded)")
    phases = [p for p in PHASES if p in result.phase_peak_mem_bytes or p in result.phase_s]
    if phases:
        lines.append(f"  {'phase':<12}{'seconds':>9}{'peak device memory':>21}")
        for phase in phases:
            seconds = result.phase_s.get(phase)
            shown = f"{seconds:.2f}" if seconds is not None else "-"
            peak = format_bytes(result.phase_peak_mem_bytes.get(phase))
            lines.append(f"  {phase:<12}{shown:>9}{peak:>21}")
    capacity = format_bytes(result.device_capacity_bytes)
    limit = result.device_limit_bytes
    limit_text = f", limit {format_bytes(limit)}" if limit else ""
    lines.append(f"  peak device memory {format_bytes(result.peak_mem_bytes)} of {capacity}"
                 f"{limit_text}   host peak RSS {format_bytes(result.host_peak_rss_bytes)}"
                 f"   offloaded to host {format_bytes(result.host_offload_bytes)}")
    if result.fixed_cost_s is not None:
        lines.append(f"  fixed cost {result.fixed_cost_s:.1f} s (startup {result.startup_s:.1f} s,"
                     f" build {result.build_s:.1f} s)   probe wall {result.probe_wall_s:.1f} s")
    if not result.ok and result.stderr_tail:
        tail = result.stderr_tail.strip().splitlines()[-8:]
        lines.append("  stderr tail:")
        lines.extend(f"    {line}" for line in tail)
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain left-aligned table with a header row."""
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = [{c: c for c in columns}, *rows]
    return "\n".join("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns).rstrip()
                     for row in lines)
