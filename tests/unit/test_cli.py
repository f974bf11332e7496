"""CLI commands that need no process group: backends, plan, report errors."""

from typer.testing import CliRunner

from mokbench.cli import app

runner = CliRunner()


def test_backends_lists_every_backend_with_a_reason_when_unavailable():
    r = runner.invoke(app, ["backends", "--world-size", "1"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    for name in ("nccl_torch", "nccl_torch_compile", "deepep", "te", "hybridep_megatron",
                 "megatron_alltoall", "mok_upstream", "mok"):
        assert name in r.output
    lines = [ln for ln in r.output.splitlines() if " no " in ln]
    assert lines and all(len(ln.split("│")[4].strip()) > 0 for ln in lines)
    assert "mokbench[te]" in r.output  # install hint survives rich markup


def test_plan_reproduces_published_minibatch():
    r = runner.invoke(app, ["plan", "--hidden", "7168", "--intermediate", "2048", "--sms", "148",
                            "--comm-sms", "0"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "2368" in r.output


def test_report_rejects_bad_format_and_missing_run(tmp_path):
    r = runner.invoke(app, ["report", str(tmp_path), "--format", "xml"])
    assert r.exit_code == 2 and "format='xml' is invalid" in r.output
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "has no rows.jsonl" in r.output
