"""`python -m launch.gpucheck` on CPU: the refusal, the time budget (jobs that would pass the deadline are
skipped, a job running at the deadline is stopped, the files are rewritten after every job and stay
readable), the tables made from a recorded result (a fixture written here, not a measurement), and each job
at tiny sizes, so that the first GPU run does not stop on a typo."""

import copy
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import configs
from launch import gpucheck
from launch.gpucheck import jobs as job_functions, record, sections as section_plan, tables
from meshpar import config as config_lib
from meshpar.metrics import strict

ROOT = Path(__file__).resolve().parents[1]

# FIXTURE: a made-up result in the shape gpucheck.json has, for the table tests and as the rows the stand-in
# job runner returns. No figure in it was measured.
FIXTURE = json.loads("""
{"command": "python -m launch.gpucheck --minutes 8", "started": "2000-01-01T00:00:00+00:00", "budget_s": 480,
 "elapsed_s": 470, "sections": [
  {"name": "machine", "title": "1. The machine", "status": "done",
   "jobs": [{"job": "machine", "status": "done", "wall_s": 9.0, "estimate_s": 60, "reason": null}],
   "rows": [{"job": "machine", "platform": "gpu", "device_kind": "FIXTURE-GPU", "device_count": 2,
             "memory_stats": {"bytes_limit": 60000000000}, "jax": "0.0.0", "jaxlib": "0.0.0",
             "cuda_packages": {"jax-cuda12-plugin": "0.0.0"}, "xla_flags": "--xla_fixture=true",
             "python": "3.11.0", "environment": "fixture",
             "gpu_target": {"own": {"core_count": 132}, "packaged": "h100",
                            "differences": [["device_memory_size", 85000000000, 84978434048]]}}]},
  {"name": "numerics", "title": "2. Attention numerics", "status": "done",
   "jobs": [{"job": "bf16 against float32", "status": "done", "wall_s": 20.0, "estimate_s": 120, "reason": null}],
   "rows": [{"job": "bf16 against float32", "kernel": "blockwise", "head_dim": 64, "T": 2048, "heads": 32,
             "kv_heads": 8, "out": 0.00123, "dq": 0.0045, "dk": 0.0031, "dv": 0.0027},
            {"job": "bf16 against float32", "kernel": "cudnn", "head_dim": 256, "T": 2048, "heads": 32,
             "kv_heads": 8, "note": "head dim 256 is not a multiple of 8 up to 128"}]},
  {"name": "speed", "title": "3. Attention speed", "status": "partial",
   "jobs": [{"job": "T=2048", "status": "done", "wall_s": 30.0, "estimate_s": 90, "reason": null},
            {"job": "T=32768", "status": "skipped", "wall_s": null, "estimate_s": 180,
             "reason": "needs up to 180 s, 100 s left"}],
   "rows": [{"job": "T=2048", "kernel": "cudnn", "T": 2048, "batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "forward_ms": 0.25, "forward_backward_ms": 0.875},
            {"job": "T=2048", "kernel": "dense", "T": 2048, "batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "note": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}]},
  {"name": "training", "title": "4. Training", "status": "done",
   "jobs": [{"job": "defaults", "status": "done", "wall_s": 100.0, "estimate_s": 300, "reason": null},
            {"job": "launch.compile", "status": "done", "wall_s": 40.0, "estimate_s": 120, "reason": null}],
   "rows": [{"job": "defaults", "config": "llama_1b", "mesh": "data=1", "devices": 1, "seq_len": 4096,
             "global_batch": 2, "remat": "none", "attention_kernel": "cudnn", "offload": "none", "step_time_s": 0.5,
             "tokens_per_s": 16000.0, "mfu": null, "peak_flops_source": "unknown GPU 'FIXTURE-GPU'",
             "compiled_peak_bytes": 44000000000, "measured_peak_bytes": 45100000000, "compile_s": 30.0,
             "params": 1235814400, "loss_first": 11.9, "loss_last": 7.5},
            {"job": "launch.compile", "layout": "data=1 zero=3 remat=none", "compiled_cpu_peak_bytes": 43000000000,
             "planner_peak_bytes": 44400000000, "planner_cpu_peak_bytes": 44500000000, "compile_s": 5.0}]},
  {"name": "ab", "title": "5. A/B", "status": "partial",
   "jobs": [{"job": "remat=dots", "status": "done", "wall_s": 60.0, "estimate_s": 100.0, "reason": null},
            {"job": "offload optimizer", "status": "failed", "wall_s": 20.0, "estimate_s": 100.0,
             "reason": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"},
            {"job": "remat=full", "status": "skipped", "wall_s": null, "estimate_s": 100.0,
             "reason": "needs up to 100 s, 50 s left"}],
   "rows": [{"job": "remat=dots", "config": "llama_1b", "mesh": "data=1", "devices": 1, "seq_len": 4096,
             "global_batch": 2, "remat": "dots", "attention_kernel": "cudnn", "offload": "none", "step_time_s": 0.6,
             "tokens_per_s": 13653.0, "mfu": null, "peak_flops_source": "unknown GPU 'FIXTURE-GPU'",
             "compiled_peak_bytes": 28000000000, "measured_peak_bytes": null, "compile_s": 30.0,
             "params": 1235814400, "loss_first": 11.9, "loss_last": 7.5}]},
  {"name": "multi", "title": "6. Several GPUs", "status": "done",
   "jobs": [{"job": "fsdp=2", "status": "done", "wall_s": 90.0, "estimate_s": 100.0, "reason": null}],
   "rows": [{"job": "fsdp=2", "config": "llama_1b", "mesh": "fsdp=2", "devices": 2, "seq_len": 4096,
             "global_batch": 4, "remat": "none", "attention_kernel": "cudnn", "offload": "none", "step_time_s": 0.55,
             "tokens_per_s": 30000.0, "mfu": null, "peak_flops_source": "unknown GPU 'FIXTURE-GPU'",
             "compiled_peak_bytes": 30000000000, "measured_peak_bytes": 31000000000, "compile_s": 40.0,
             "params": 1235814400, "loss_first": 11.9, "loss_last": 7.5}]}]}
""")


def fixture_row(job_label: str) -> dict:
    """The fixture's row of `job_label`, without its label (as a job prints it)."""
    row = copy.deepcopy(tables.find_row(FIXTURE, job_label))
    del row["job"]
    return row


FIXTURE_ROWS = {"machine": "machine", "attention_numerics": "bf16 against float32", "attention_speed": "T=2048",
                "train": "defaults", "compile": "launch.compile"}


class Clock:
    """A stand-in for time.monotonic that the stand-in jobs advance."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StandInJobs:
    """Runs no process: each job takes `took_s(job)` of the clock and returns the fixture's row of its kind.
    Before each, it reads gpucheck.json from disk: every job recorded so far must be there already."""

    def __init__(self, clock: Clock, out: Path, took_s=lambda job: job.estimate_s / 2, gpus: int = 1):
        self.clock, self.out, self.took_s, self.gpus = clock, out, took_s, gpus
        self.ran: list[record.Job] = []
        self.recorded = 1  # the machine's

    def __call__(self, job: record.Job, timeout_s: float, log: Path) -> record.Outcome:
        on_disk = json.loads((self.out / "gpucheck.json").read_text())
        assert sum(len(section["jobs"]) for section in on_disk["sections"]) == len(self.ran) + self.recorded
        assert timeout_s == pytest.approx(self.check.deadline - self.clock())  # stopped at the deadline
        self.ran.append(job)
        took = self.took_s(job)
        self.clock.now += took
        return record.Outcome("done", [fixture_row(FIXTURE_ROWS[job.function])], took)

    def start(self, deadline: float) -> record.Check:
        """A Check with the machine (`gpus` of them) recorded, as `main` leaves it."""
        self.check = record.Check(self.out, deadline, "python -m launch.gpucheck", run_job=self, clock=self.clock)
        self.check.open_section("machine", section_plan.SECTIONS["machine"][0])
        self.check.record(section_plan.MACHINE, record.Outcome("done", [{**fixture_row("machine"),
                                                                      "device_count": self.gpus}], 9.0))
        self.check.close_section()
        return self.check


def statuses(doc: dict) -> dict[str, str]:
    return {section["name"]: section["status"] for section in doc["sections"]}


def jobs_of(doc: dict, section: str) -> dict[str, dict]:
    return {job["job"]: job for s in doc["sections"] if s["name"] == section for job in s["jobs"]}


# ---- the refusal ------------------------------------------------------------------------------------------------

def test_without_a_cuda_plugin_it_refuses_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "launch.gpucheck", "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpucheck: no GPU here"), lines
    assert not (tmp_path / "out").exists()


def test_with_the_plugin_but_no_gpu_it_refuses_after_asking_jax(tmp_path, monkeypatch, capsys):
    """The machine job runs in a child process (this one's JAX_PLATFORMS=cpu) and reports the CPU."""
    monkeypatch.setattr(gpucheck.gpu_flags, "cuda_installed", lambda: True)
    with pytest.raises(SystemExit) as stopped:
        gpucheck.main(["--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == ("gpucheck: no GPU here (jax runs on cpu); it measures meshpar on GPUs "
                                               "only")
    assert not (tmp_path / "gpucheck.json").exists()


# ---- the time budget -------------------------------------------------------------------------------------------

def test_jobs_that_would_pass_the_deadline_are_skipped_and_each_job_is_flushed(tmp_path):
    clock = Clock()
    jobs = StandInJobs(clock, tmp_path)  # each job takes half its estimate
    check = jobs.start(deadline=400)
    section_plan.run_sections(check, ["numerics", "speed", "training", "ab", "multi"])
    # numerics 120 s → 60; speed 90, 120, 180 → 45, 60, 90 (255 s used): then the defaults' 300 s do not fit
    assert [job.label for job in jobs.ran] == ["bf16 against float32", "T=2048", "T=8192", "T=32768"]
    doc = json.loads((tmp_path / "gpucheck.json").read_text())
    assert doc == check.doc
    assert statuses(doc) == {"machine": "done", "numerics": "done", "speed": "done", "training": "skipped",
                             "ab": "skipped", "multi": "skipped"}
    assert jobs_of(doc, "training")["defaults"]["reason"] == "needs up to 300 s, 145 s left"
    assert not jobs_of(doc, "ab")  # the defaults were tried (skipped) already: not again
    sections = {s["name"]: s for s in doc["sections"]}
    assert sections["multi"]["reason"] == "1 GPU: nothing to scale across"
    md = (tmp_path / "gpucheck.md").read_text()
    assert "- `defaults`: skipped (needs up to 300 s, 145 s left)" in md
    assert "Status: skipped: the A/B compares with the defaults' run, which did not finish." in md


def test_a_measured_training_job_is_the_estimate_of_its_variants(tmp_path):
    clock = Clock()
    jobs = StandInJobs(clock, tmp_path, took_s=lambda job: 100.0, gpus=2)
    check = jobs.start(deadline=450)
    section_plan.run_sections(check, ["ab", "multi"])
    # the defaults (estimate 300) take 100 s; then each variant is budgeted at those 100 s: three fit
    assert [job.label for job in jobs.ran] == ["defaults", "gpu flags off", "remat=dots", "remat=full"]
    flags_off = jobs.ran[1]
    assert not flags_off.gpu_flags and "train.remat=none" in flags_off.args["overrides"]
    ab = jobs_of(check.doc, "ab")
    assert ab["attention blockwise"] == {"job": "attention blockwise", "status": "skipped", "wall_s": None,
                                         "estimate_s": 100.0, "reason": "needs up to 100 s, 50 s left"}
    assert statuses(check.doc)["ab"] == "partial"
    assert {job["estimate_s"] for job in jobs_of(check.doc, "multi").values()} == {100.0}
    assert statuses(check.doc)["multi"] == "skipped"


def test_a_failing_job_and_a_failing_section_are_recorded_and_the_next_goes_on(tmp_path, monkeypatch):
    clock = Clock()
    jobs = StandInJobs(clock, tmp_path)

    def run_job(job, timeout_s, log):
        if job.function == "attention_numerics":
            jobs.recorded += 1  # a job the stand-in did not run
            return record.Outcome("failed", [], 3.0, "JaxRuntimeError: INTERNAL: cuDNN fixture failure")
        return jobs(job, timeout_s, log)

    def planning_fault(check):
        raise KeyError("remat")

    monkeypatch.setitem(section_plan.SECTIONS, "training", (section_plan.SECTIONS["training"][0], planning_fault))
    check = jobs.start(deadline=10_000)
    check.run_job = run_job
    section_plan.run_sections(check, ["numerics", "training", "speed"])
    sections = {s["name"]: s for s in check.doc["sections"]}
    assert sections["numerics"]["status"] == "failed"
    assert sections["numerics"]["jobs"][0]["reason"] == "JaxRuntimeError: INTERNAL: cuDNN fixture failure"
    assert sections["training"]["status"] == "failed" and sections["training"]["reason"] == "KeyError: 'remat'"
    assert sections["speed"]["status"] == "done"
    md = (tmp_path / "gpucheck.md").read_text()
    assert "- `bf16 against float32`: failed (JaxRuntimeError: INTERNAL: cuDNN fixture failure)" in md
    assert "Status: failed: KeyError: 'remat'." in md


def test_a_training_job_whose_loss_is_nan_fails_its_table(tmp_path):
    """The defaults' run ends on a NaN loss, printed as the job prints it (JSON holds no NaN: None): failed,
    saying so under section 4's table, whose row stays as measured; the launch.compile job after it is done."""
    clock = Clock()
    jobs = StandInJobs(clock, tmp_path)

    def run_job(job, timeout_s, log):
        outcome = jobs(job, timeout_s, log)
        if job.label != "defaults":
            return outcome
        printed = [json.loads(json.dumps(strict({**row, "loss_last": float("nan")}))) for row in outcome.rows]
        return dataclasses.replace(outcome, rows=printed)

    check = jobs.start(deadline=10_000)
    check.run_job = run_job
    section_plan.run_sections(check, ["training"])
    doc = json.loads((tmp_path / "gpucheck.json").read_text())
    training = jobs_of(doc, "training")
    assert training["defaults"]["status"] == "failed" and training["launch.compile"]["status"] == "done"
    assert training["defaults"]["reason"] == "the loss is not finite (loss 11.9 → not finite)"
    assert statuses(doc)["training"] == "partial"
    md = (tmp_path / "gpucheck.md").read_text().splitlines()
    assert "- `defaults`: failed (the loss is not finite (loss 11.9 → not finite))" in md
    assert any(line.startswith("| llama_1b | 4,096 |") for line in md)


def numerics_run(out: Path, rows: list[dict]) -> tuple[dict, list[str]]:
    """gpucheck.json and gpucheck.md's lines after the numerics section, its job's rows `rows`, printed as the
    job prints them (NaN and ∞ as None: JSON holds neither)."""
    jobs = StandInJobs(Clock(), out)

    def run_job(job, timeout_s, log):
        printed = [json.loads(json.dumps(strict(row))) for row in rows]
        return dataclasses.replace(jobs(job, timeout_s, log), rows=printed)

    check = jobs.start(deadline=10_000)
    check.run_job = run_job
    section_plan.run_sections(check, ["numerics"])
    return json.loads((out / "gpucheck.json").read_text()), (out / "gpucheck.md").read_text().splitlines()


def test_a_kernel_error_that_is_nan_is_a_failure_not_a_figure_not_measured(tmp_path):
    """cuDNN's dq comes out NaN beside blockwise's finite errors: its cell says so instead of – (which is a
    kernel not measured), and the job and the section are partial; where no kernel's errors are finite, failed."""
    fine = fixture_row("bf16 against float32")  # blockwise, head dim 64
    nan_dq = {**fine, "kernel": "cudnn", "head_dim": 128, "dq": float("nan")}
    doc, md = numerics_run(tmp_path / "one", [fine, nan_dq])
    job = jobs_of(doc, "numerics")["bf16 against float32"]
    assert job["status"] == statuses(doc)["numerics"] == "partial"
    assert "| cudnn | 128 | 1.2e-03 | not finite | 3.1e-03 | 2.7e-03 |  |" in md
    assert "| blockwise | 64 | 1.2e-03 | 4.5e-03 | 3.1e-03 | 2.7e-03 |  |" in md
    assert "- `bf16 against float32`: partial (the error is not finite (cudnn, head dim 128: dq))" in md
    doc, _ = numerics_run(tmp_path / "all", [nan_dq, {**fine, "out": float("inf")}])
    assert statuses(doc)["numerics"] == "failed"
    assert jobs_of(doc, "numerics")["bf16 against float32"]["reason"] == (
        "the error is not finite (cudnn, head dim 128: dq; blockwise, head dim 64: out)")


class OutlivesTheDeadline(record.Job):
    """A child that prints one row, then half of another, then sleeps past any deadline."""

    def command(self) -> list[str]:
        code = ("import sys, time; print('gpucheck-row {\"kernel\": \"fixture\", \"T\": 1}', flush=True); "
                "sys.stdout.write('gpucheck-row {\"ker'); sys.stdout.flush(); time.sleep(120)")
        return [sys.executable, "-c", code]


def test_a_job_running_at_the_deadline_is_stopped_its_rows_kept_and_the_files_stay_readable(tmp_path):
    check = record.Check(tmp_path, time.monotonic() + 2.0, "python -m launch.gpucheck")
    check.open_section("speed", section_plan.SECTIONS["speed"][0])
    outcome = check.job(OutlivesTheDeadline("T=1", "attention_speed", {}, estimate_s=0))
    check.close_section()
    assert outcome.status == "cut off" and outcome.reason.startswith("stopped at the deadline after")
    assert outcome.rows == [{"kernel": "fixture", "T": 1}]  # the whole line; not the half one
    doc = json.loads((tmp_path / "gpucheck.json").read_text())
    assert doc["sections"][0]["status"] == "cut off" and len(doc["sections"][0]["rows"]) == 1
    lines = (tmp_path / "gpucheck.md").read_text().splitlines()
    assert "| 1 | fixture | – | – |  |" in lines
    assert any(line.startswith("- `T=1`: cut off (stopped at the deadline after") for line in lines)
    assert (tmp_path / "logs" / "00-T=1.log").read_text().startswith("$ ")


def test_every_planned_job_fits_its_function_and_its_settings_parse(tmp_path):
    """The GPU sizes' jobs, planned without running: their arguments bind to the job functions and their
    overrides apply to the preset (nothing is built)."""
    clock = Clock()
    jobs = StandInJobs(clock, tmp_path, gpus=8)
    section_plan.run_sections(jobs.start(deadline=1e9), ["numerics", "speed", "training", "ab", "multi"])
    assert len(jobs.ran) == 1 + 3 + 2 + 5 + 2
    for job in jobs.ran:
        inspect.signature(job_functions.JOBS[job.function]).bind(**json.loads(json.dumps(job.args)))
        if "overrides" in job.args:
            config_lib.apply(configs.load(job.args["config"]), job.args["overrides"])
    meshes = {job.args["mesh"]: job.args for job in jobs.ran if job.function == "train"}
    assert meshes["fsdp=8"]["devices"] == 8 and "train.global_batch=16" in meshes["fsdp=8"]["overrides"]
    assert statuses(jobs.check.doc) == dict.fromkeys(["machine", "numerics", "speed", "training", "ab", "multi"],
                                                     "done")


# ---- the tables ---------------------------------------------------------------------------------------------------

def test_the_tables_from_a_recorded_result():
    md = tables.markdown(FIXTURE)
    lines = md.splitlines()
    assert lines[0] == "# meshpar gpucheck on 2 × FIXTURE-GPU, jax 0.0.0"
    assert "| device | 2 × FIXTURE-GPU (gpu) |" in lines
    assert "| XLA_FLAGS | `--xla_fixture=true` |" in lines
    assert ("| packaged target (launch.compile --target) | h100: differs in device_memory_size 85000000000 "
            "(packaged 84978434048) |") in lines
    assert "| blockwise | 64 | 1.2e-03 | 4.5e-03 | 3.1e-03 | 2.7e-03 |  |" in lines
    assert "| cudnn | 256 | – | – | – | – | head dim 256 is not a multiple of 8 up to 128 |" in lines
    assert "| 2,048 | cudnn | 0.25 | 0.88 |  |" in lines
    assert "| 2,048 | dense | – | – | JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory |" in lines
    assert "- `T=32768`: skipped (needs up to 180 s, 100 s left)" in lines
    # no MFU where the GPU's peak is unknown: absent, not guessed
    assert "| llama_1b | 4,096 | 2 | none | cudnn | 500 | 16,000 | – | 45.1 | 44.0 | 43.0 | 44.4 |" in lines
    assert "| defaults | none | cudnn | none | 500 | 1.00 | 16,000 | 45.1 | 44.0 |" in lines
    assert "| remat=dots | dots | cudnn | none | 600 | 1.20 | 13,653 | – | 28.0 |" in lines
    assert "- `offload optimizer`: failed (JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory)" in lines
    assert not any(line.startswith("| remat=full") or line.startswith("| offload") for line in lines)
    assert "| data=1 | 1 | 2 | none | 500 | 16,000 | 16,000 | 1.00 | 45.1 |" in lines
    assert "| fsdp=2 | 2 | 4 | none | 550 | 30,000 | 15,000 | 0.94 | 31.0 |" in lines


# ---- each job at tiny sizes, on CPU ----------------------------------------------------------------------------

TINY = ["model.n_layers=1", "train.seq_len=32"]


def test_machine_job():
    (row,) = job_functions.machine()
    assert row["platform"] == "cpu" and row["device_count"] == 8 and row["jax"]


def test_attention_numerics_job():
    """T = 256: two of the CPU's 128-position tiles. bf16 against float32: errors of bf16's size."""
    rows = {row["kernel"]: row for row in job_functions.attention_numerics(T=256, heads=4, kv_heads=2, head_dims=[16])}
    for kernel in ("dense", "blockwise"):
        assert all(0 < rows[kernel][name] < 2e-2 for name in ("out", "dq", "dk", "dv")), rows[kernel]
    assert rows["cudnn"]["note"] == "not available on cpu" and "out" not in rows["cudnn"]


def test_attention_speed_job():
    rows = list(job_functions.attention_speed(T=256, kernels=["blockwise", "cudnn"], heads=4, kv_heads=2, head_dim=16,
                                         repeats=1))
    assert rows[0]["forward_ms"] > 0 and rows[0]["forward_backward_ms"] > 0
    assert rows[1] == {"kernel": "cudnn", "T": 256, "batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 16,
                       "note": "not available on cpu"}


@pytest.mark.parametrize(("mesh", "devices", "batch"), [("", 1, 2), ("fsdp=2", 2, 4)])
def test_train_job(mesh, devices, batch):
    (row,) = job_functions.train("tiny", [*TINY, f"train.global_batch={batch}"], mesh, devices, steps=3)
    assert row["devices"] == devices and row["global_batch"] == batch and row["remat"] == "dots"
    assert row["attention_kernel"] == "dense" and row["step_time_s"] > 0 and row["mfu"] > 0
    assert row["compiled_peak_bytes"] > 0 and row["measured_peak_bytes"] is None  # CPU devices keep no statistics


def test_compile_job():
    (row,) = job_functions.compile_peak("tiny", [*TINY, "train.global_batch=8", "train.remat=dots"], "fsdp=8")
    assert row["layout"].startswith("fsdp=8") and row["compiled_cpu_peak_bytes"] > 0
    assert row["planner_peak_bytes"] > 0 and row["planner_cpu_peak_bytes"] > 0
