"""Row schema and the append-only writer."""

import json

import pytest

from mokbench.results import ROW_COLUMNS, RowWriter, new_row, read_rows


def test_new_row_has_every_column_in_order():
    row = new_row(status="ok", backend="nccl_torch", extra_col=3)
    assert list(row)[: len(ROW_COLUMNS)] == list(ROW_COLUMNS)
    assert row["extra_col"] == 3 and row["median_ms"] is None


def test_bad_status_rejected():
    with pytest.raises(ValueError, match="status='great' is invalid: allowed ok"):
        new_row(status="great")


def test_writer_appends_and_reader_skips_torn_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    w = RowWriter(path)
    w.append(new_row(status="ok", backend="a"))
    w.append(new_row(status="failed", backend="b", reason="boom"))
    with open(path, "a") as f:
        f.write('{"run_id": "x", "trunc')  # a crash mid-write
    rows = read_rows(path)
    assert [r["backend"] for r in rows] == ["a", "b"]
    assert json.loads(path.read_text().splitlines()[1])["reason"] == "boom"


def _git(repo, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


def test_git_dirty_leaves_out_the_runs_own_folder(tmp_path):
    """A fresh clone is clean although the run writes results/ (or --out) inside it; a change
    to a tracked file, or a new file elsewhere, makes it dirty."""
    from mokbench.results import git_dirty

    repo = tmp_path / "clone"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "code.py")
    _git(repo, "commit", "-q", "-m", "c")
    assert git_dirty(repo=repo) is False
    (repo / "results" / "20260101-000000-t").mkdir(parents=True)
    (repo / "results" / "20260101-000000-t" / "rows.jsonl").write_text("{}\n")
    (repo / "mine" / "run").mkdir(parents=True)
    (repo / "mine" / "run" / "env.json").write_text("{}")
    assert git_dirty(repo / "mine" / "run", repo=repo) is False
    assert git_dirty(repo=repo) is True  # mine/run is an ordinary untracked folder then
    (repo / "code.py").write_text("x = 2\n")
    assert git_dirty(repo / "mine" / "run", repo=repo) is True


def test_code_trees_name_the_code_that_ran_even_over_an_older_head(tmp_path):
    """code_trees gives each code folder's git tree id as its files stand: HEAD's when clean,
    another after an edit, and, with the files of a later commit over an older HEAD (a tree
    copied over a stale .git), that later commit's; it writes no object into the repository."""
    import subprocess

    from mokbench.results import code_trees

    def rev(*args):
        return subprocess.run(["git", "rev-parse", *args], cwd=repo, capture_output=True,
                              text=True, check=True).stdout.strip()

    def objects():
        return sorted(p.name for p in (repo / ".git" / "objects").rglob("*") if p.is_file())

    repo = tmp_path / "clone"
    (repo / "mok_kernels").mkdir(parents=True)
    (repo / "mokbench").mkdir()
    (repo / "mok_kernels" / "k.py").write_text("a = 1\n")
    (repo / "mokbench" / "m.py").write_text("b = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    first = rev("HEAD")
    assert code_trees(repo) == {"mok_kernels": rev("HEAD:mok_kernels"),
                                "mokbench": rev("HEAD:mokbench")}
    (repo / "mok_kernels" / "k.py").write_text("a = 2\n")
    before = objects()
    edited = code_trees(repo)
    assert edited["mok_kernels"] != rev("HEAD:mok_kernels")
    assert edited["mokbench"] == rev("HEAD:mokbench")
    assert objects() == before  # nothing written into the repository
    _git(repo, "commit", "-q", "-am", "two")
    second = rev("HEAD:mok_kernels")
    assert edited["mok_kernels"] == second
    _git(repo, "reset", "-q", "--soft", first)  # HEAD older than the files
    assert code_trees(repo)["mok_kernels"] == second != rev(f"{first}:mok_kernels")
    assert code_trees(tmp_path) is None  # not a checkout


def test_env_json_records_the_variables_that_change_a_run(monkeypatch):
    """capture_env keeps the communication, allocator, compiler and backend-knob variables
    set where the sweep starts, and nothing else of the shell (no HOME, no tokens)."""
    from mokbench.results import capture_env

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("MOKBENCH_MOK_CONFIG", '{"minibatch": 512}')
    monkeypatch.setenv("HF_TOKEN", "secret")
    env = capture_env()["environment"]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["MOKBENCH_MOK_CONFIG"] == '{"minibatch": 512}'
    assert "HF_TOKEN" not in env and "HOME" not in env and "PATH" not in env
    assert list(env) == sorted(env)
