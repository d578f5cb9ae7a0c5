"""gpucheck.md: the tables of a gpucheck.json; a figure not measured is absent (–), a kernel's error
measured as NaN or ∞ is "not finite"."""

from __future__ import annotations

from launch.gpucheck.jobs import ERRORS

GB = 1e9


def find_row(doc: dict, label: str) -> dict | None:
    """The first row of the job `label` in any section."""
    return next((row for section in doc["sections"] for row in section["rows"] if row["job"] == label), None)


def cell(value, spec: str = "") -> str:
    """`value` formatted, or – where it was not measured."""
    return "–" if value is None else format(value, spec)


def gb(value) -> str:
    return cell(None if value is None else value / GB, ".1f")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *["| " + " | ".join(row) + " |" for row in rows]]


def machine_table(section: dict, doc: dict) -> list[str]:
    m = section["rows"][0]
    packages = ", ".join(f"{name} {version}" for name, version in m["cuda_packages"].items()) or "–"
    limit = (m["memory_stats"] or {}).get("bytes_limit")
    return table(["", ""], [["device", f"{m['device_count']} × {m['device_kind']} ({m['platform']})"],
                            ["GB per device for XLA (memory_stats' bytes_limit)", gb(limit)],
                            ["jax, jaxlib", f"{m['jax']}, {m['jaxlib']}"], ["CUDA packages", packages],
                            ["XLA_FLAGS", f"`{m['xla_flags']}`" if m["xla_flags"] else "–"],
                            ["Python", m["python"]], ["packaged target (launch.compile --target)", target_cell(m)]])


def target_cell(machine: dict) -> str:
    """The packaged GPU target of this device kind, and the fields where the device's own description differs."""
    target = machine.get("gpu_target")
    if target is None:
        return "–"
    if "error" in target:
        return f"own description not readable: {target['error']}"
    if target["packaged"] is None:
        return "none for this device kind"
    differs = "; ".join(f"{name} {own} (packaged {packaged})" for name, own, packaged in target["differences"])
    return f"{target['packaged']}: " + (f"differs in {differs}" if differs else "the same in every field")


def error_cell(row: dict, key: str) -> str:
    """A kernel's relative error: – where the kernel was not measured, "not finite" where it was and the error
    is NaN or ∞ (which the job prints as None)."""
    return "not finite" if key in row and row[key] is None else cell(row.get(key), ".1e")


def numerics_table(section: dict, doc: dict) -> list[str]:
    return table(["kernel", "head dim", *ERRORS, "note"],
                 [[r["kernel"], str(r["head_dim"]), *[error_cell(r, k) for k in ERRORS], r.get("note", "")]
                  for r in section["rows"]])


def speed_table(section: dict, doc: dict) -> list[str]:
    return table(["T", "kernel", "forward ms", "forward + backward ms", "note"],
                 [[f"{r['T']:,}", r["kernel"], cell(r.get("forward_ms"), ",.2f"),
                   cell(r.get("forward_backward_ms"), ",.2f"), r.get("note", "")] for r in section["rows"]])


def training_table(section: dict, doc: dict) -> list[str]:
    run, compiled = find_row(doc, "defaults"), find_row(doc, "launch.compile") or {}
    if run is None:
        return []
    return table(["config", "T", "batch", "remat (auto's choice)", "attention", "step ms", "tokens/s", "MFU",
                  "peak GB, measured", "peak GB, compiled here", "`launch.compile` GB (CPU)", "planner GB"],
                 [[run["config"], f"{run['seq_len']:,}", str(run["global_batch"]), run["remat"],
                   run["attention_kernel"], cell(run["step_time_s"] * 1e3, ",.0f"), cell(run["tokens_per_s"], ",.0f"),
                   cell(run["mfu"], ".1%"), gb(run["measured_peak_bytes"]), gb(run["compiled_peak_bytes"]),
                   gb(compiled.get("compiled_cpu_peak_bytes")), gb(compiled.get("planner_peak_bytes"))]])


def ab_table(section: dict, doc: dict) -> list[str]:
    base = find_row(doc, "defaults")
    if base is None:
        return []
    rows = [base, *[r for r in section["rows"] if r["job"] != "defaults"]]  # the defaults once, first
    return table(["variant", "remat", "attention", "offload", "step ms", "step time / defaults", "tokens/s",
                  "peak GB, measured", "peak GB, compiled"],
                 [[r["job"], r["remat"], r["attention_kernel"], r["offload"], cell(r["step_time_s"] * 1e3, ",.0f"),
                   cell(r["step_time_s"] / base["step_time_s"], ".2f"), cell(r["tokens_per_s"], ",.0f"),
                   gb(r["measured_peak_bytes"]), gb(r["compiled_peak_bytes"])] for r in rows])


def multi_table(section: dict, doc: dict) -> list[str]:
    base = find_row(doc, "defaults")  # one GPU
    rows = ([base] if base else []) + [r for r in section["rows"] if r["job"] != "defaults"]
    one_gpu = base["tokens_per_s"] if base else None
    return table(["mesh", "GPUs", "global batch", "remat", "step ms", "tokens/s", "tokens/s per GPU",
                  "scaling (per GPU / one GPU)", "peak GB, measured"],
                 [[r["mesh"], str(r["devices"]), str(r["global_batch"]), r["remat"],
                   cell(r["step_time_s"] * 1e3, ",.0f"), cell(r["tokens_per_s"], ",.0f"),
                   cell(r["tokens_per_s"] / r["devices"], ",.0f"),
                   cell(None if one_gpu is None else r["tokens_per_s"] / r["devices"] / one_gpu, ".2f"),
                   gb(r["measured_peak_bytes"])] for r in rows])


TABLES = {"machine": machine_table, "numerics": numerics_table, "speed": speed_table, "training": training_table,
          "ab": ab_table, "multi": multi_table}


def markdown(doc: dict) -> str:
    """The report: a header, then per section its status, its table, and each job not done with why."""
    m = find_row(doc, "machine")
    where = f" on {m['device_count']} × {m['device_kind']}, jax {m['jax']}" if m else ""
    lines = [f"# meshpar gpucheck{where}", "",
             f"`{doc['command']}`, started {doc['started']}, {doc['elapsed_s']} s of a {doc['budget_s']} s budget. "
             "GB = 1e9 bytes. A figure not measured is absent (–); why is under its table.", ""]
    for section in doc["sections"]:
        status = section["status"] + (f": {section['reason']}" if section.get("reason") else "")
        lines += [f"## {section['title']}", "", f"Status: {status}.", ""]
        if section["rows"]:
            lines += [*TABLES[section["name"]](section, doc), ""]
        unfinished = [j for j in section["jobs"] if j["status"] != "done"]
        lines += [f"- `{j['job']}`: {j['status']}" + (f" ({j['reason']})" if j["reason"] else "") for j in unfinished]
        lines += [""] if unfinished else []
    return "\n".join(lines)
