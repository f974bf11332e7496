"""The command line: a thin typer layer over sweep expansion, the launcher and the report."""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from mokbench.errors import InputError, require

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Benchmark full MoE layers across MoE stacks (MoK megakernel vs baselines).")
console = Console()
F = TypeVar("F", bound=Callable)


def _fail(msg: str) -> NoReturn:
    """One line on stdout, exit code 2 (the message is text, not rich markup)."""
    console.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True, highlight=False)
    raise typer.Exit(2)


class _WarningHandler(logging.Handler):
    """The package's warnings (e.g. a skipped line of rows.jsonl) as one line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {escape(record.getMessage())}",
                                   soft_wrap=True, highlight=False)


_log = logging.getLogger("mokbench")
if not any(isinstance(h, _WarningHandler) for h in _log.handlers):
    _log.addHandler(_WarningHandler(logging.WARNING))


def _user_errors(fn: F) -> F:
    """A command whose user mistakes (:class:`InputError`) end as one line and exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            _fail(str(exc))

    return wrapper  # type: ignore[return-value]


def _positive(**values: int | None) -> None:
    """Each given value (None: not given) must be an integer >= 1."""
    for name, v in values.items():
        if v is not None:
            require(v >= 1, name, v, "a positive integer")


def _split(values: list[str] | None) -> list[str] | None:
    """Backend labels from comma lists. A label's own options also use commas
    (``mok@tma=true,num_stages=4``), so a piece with ``=`` and no ``@`` continues the label
    before it. An option given with nothing in it is an error, not "every backend"."""
    if values is None:
        return None
    labels: list[str] = []
    for piece in (v.strip() for item in values for v in item.split(",")):
        if not piece:
            continue
        if labels and "@" in labels[-1] and "=" in piece and "@" not in piece:
            labels[-1] += "," + piece
        else:
            labels.append(piece)
    if not labels:
        raise InputError(f"backends={','.join(values)!r} is invalid: allowed a comma list of "
                         "backend names (`mokbench backends` lists them)")
    return labels


@app.command()
@_user_errors
def sweep(
    sweep_file: Path = typer.Argument(None, help="TOML/YAML sweep; default: the embedded one"),
    backends: list[str] = typer.Option(None, "--backends", "-b",
                                       help="only these backends (comma list)"),
    nproc_per_node: int = typer.Option(None, help="ranks per node (default: GPUs, or 2 on CPU)"),
    nnodes: int = typer.Option(None, help="number of nodes (default 1, or the resumed run's)"),
    node_rank: int = typer.Option(0, help="this node's rank"),
    rdzv_endpoint: str = typer.Option("localhost:29500", help="HOST:PORT of node 0"),
    out: Path = typer.Option(Path("results"), help="folder that receives the run folder"),
    resume: Path = typer.Option(None, help="run folder to complete"),
    dry_run: bool = typer.Option(False, help="print the cells and commands, run nothing"),
    timeout_s: float = typer.Option(900.0, help="per-cell wall-clock limit, seconds"),
    device: str = typer.Option("auto", help="auto | cpu (force gloo on CPU)"),
    calibrate_first: bool = typer.Option(False, "--calibrate", help="measure ceilings first"),
    parallel: int = typer.Option(1, help="cells at once on this node, each on GPUs of its own "
                                         "(a cell of world size W takes W GPUs)"),
    rounds: int = typer.Option(None, help="run each scenario's cells R times, the order rotated "
                                          "each round, rows pooled (default: the sweep's "
                                          "[timing] rounds, else 1)"),
) -> None:
    """Expand a sweep into cells and run each through torchrun; print the summary."""
    run_dir = _run_sweep_stoppable(
        sweep_file, backends=_split(backends), nproc_per_node=nproc_per_node, nnodes=nnodes,
        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, out=out, resume=resume,
        dry_run=dry_run, timeout_s=timeout_s, device=device, calibrate_first=calibrate_first,
        console=console, parallel=parallel, rounds=rounds)
    if run_dir is not None and node_rank == 0:
        _print_report(run_dir, finish=True)


def _run_sweep_stoppable(sweep_file: Path | None, **kwargs) -> Path | None:
    """``runner.run_sweep`` with Ctrl-C and SIGTERM handled: the running cell is stopped,
    finished rows stay, and (on node 0) the run's tables, report.md and charts are made of
    them, so a sweep stopped by a time limit still leaves its report; the message names the
    folder to resume; exit 130 (Ctrl-C) or 143 (SIGTERM). A second stop skips the report."""
    from mokbench.cellpool import SweepStopped, stop_on_sigterm
    from mokbench.runner import run_sweep

    try:
        with stop_on_sigterm():
            return run_sweep(sweep_file, **kwargs)
    except KeyboardInterrupt as stop:
        code = 143 if isinstance(stop, SweepStopped) else 130
        run_dir = getattr(stop, "run_dir", None)
        console.print(f"[yellow]interrupted[/yellow]{f' by {stop}' if str(stop) else ''}: the "
                      "running cell was stopped, finished rows are kept; complete the run "
                      f"with [bold]mokbench sweep --resume {run_dir or 'RUN_DIR'}[/bold]",
                      soft_wrap=True)
        if (run_dir is not None and kwargs.get("node_rank", 0) == 0
                and (run_dir / "rows.jsonl").exists()):
            try:
                with stop_on_sigterm():
                    _print_report(run_dir, finish=True)
            except KeyboardInterrupt:
                console.print("[yellow]report skipped[/yellow]")
        raise typer.Exit(code) from None


@app.command()
@_user_errors
def run(
    backends: list[str] = typer.Option(["nccl_torch"], "--backends", "-b"),
    preset: str = typer.Option(None, help="model preset (dims below override it)"),
    experts: int = typer.Option(None), hidden: int = typer.Option(None),
    intermediate: int = typer.Option(None), topk: int = typer.Option(None),
    tokens: int = typer.Option(256, help="tokens per rank"),
    world_size: int = typer.Option(None, help="EP size (default: all local ranks)"),
    precision: str = typer.Option("bf16"), routing: str = typer.Option("uniform"),
    zipf_s: float = typer.Option(1.0), seed: int = typer.Option(1234),
    shared_expert: bool = typer.Option(True, "--shared-expert/--no-shared-expert"),
    passes: str = typer.Option("forward,backward,inference",
                               help="forward (training) | backward | inference (no_grad) | "
                                    "step (forward + backward, timed together)"),
    warmup: int = typer.Option(5), iters: int = typer.Option(20),
    out: Path = typer.Option(Path("results")), timeout_s: float = typer.Option(900.0),
    device: str = typer.Option("auto"),
) -> None:
    """Run one scenario from flags (quick ad hoc use); writes a run folder like `sweep`."""
    _positive(world_size=world_size)
    spec: dict = {"tokens_per_rank": tokens, "precision": precision, "routing": routing,
                  "zipf_s": zipf_s, "seed": seed, "shared_expert": shared_expert,
                  "passes": [p.strip() for p in passes.split(",")]}
    if preset:
        spec["preset"] = preset
    for k, v in (("num_experts", experts), ("hidden", hidden), ("intermediate", intermediate),
                 ("topk", topk)):
        if v is not None:
            spec[k] = v
    dims = ("num_experts", "hidden", "intermediate", "topk")
    if "preset" not in spec and not all(k in spec for k in dims):
        spec["preset"] = "tiny"  # fills the dims not given
    data = {"name": "adhoc", "backends": _split(backends), "timing": {"warmup": warmup,
                                                                      "iters": iters},
            "world_sizes": [world_size or "auto"], "scenarios": [spec]}
    run_dir = _run_sweep_stoppable(None, data=data, out=out, timeout_s=timeout_s,
                                   device=device, console=console)
    if run_dir is not None:
        _print_report(run_dir, finish=True)


def _print_report(run_dir: Path, finish: bool = False) -> None:
    """The run's tables; with ``finish`` (the end of a sweep or run) also report.md and the
    charts in the run folder."""
    from mokbench import report
    from mokbench.results import read_env

    df = report.load_rows(run_dir)
    if len(df):
        report.render_rich(report.summarize(df, read_env(run_dir)), console)
    if finish and len(df):
        try:
            written = report.finish_run(run_dir)
            console.print(f"wrote {written[-1].name} and {len(written) - 1} chart files")
        except Exception as exc:  # noqa: BLE001 - the rows are safe; say why the report is not
            console.print(f"[yellow]report not written[/yellow]: {type(exc).__name__}: {exc}",
                          soft_wrap=True)
    console.print(f"run folder: [bold]{run_dir}[/bold]", soft_wrap=True)


@app.command("report")
@_user_errors
def report_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder under results/"),
    format: str = typer.Option("table", "--format", "-f", help="table|md|csv|parquet|json"),
    plots: bool = typer.Option(False, "--plots", help="also write charts to RUN_DIR/plots"),
) -> None:
    """Tables (and charts) of a run: speedup over the fastest baseline, ceiling fraction."""
    from mokbench import report
    from mokbench.results import read_env

    formats = ("table", "md", "csv", "parquet", "json")
    if format not in formats:
        _fail(f"format={format!r} is invalid: allowed {' | '.join(formats)}")
    if not (run_dir / "rows.jsonl").is_file():
        _fail(f"run_dir={str(run_dir)!r} has no rows.jsonl: allowed a run folder")
    if format == "table":
        _print_report(run_dir)
    else:
        try:
            console.print(f"wrote {report.write_report(run_dir, format)}")
        except report.ReportError as exc:
            _fail(str(exc))
    if plots:
        from mokbench.plots import make_plots

        env = read_env(run_dir)
        summary = report.summarize(report.load_rows(run_dir), env)
        for p in make_plots(summary, run_dir / "plots", env):
            console.print(f"wrote {p}")


@app.command("compare")
@_user_errors
def compare_cmd(
    run_a: Path = typer.Argument(..., help="the reference run folder (A)"),
    run_b: Path = typer.Argument(..., help="the run compared with it (B)"),
    backends: list[str] = typer.Option(None, "--backends", "-b",
                                       help="only these backend labels (comma list)"),
    format: str = typer.Option("table", "--format", "-f", help="table|md|csv"),
) -> None:
    """Two runs side by side: shared rows' medians, spreads, B's speedup over A (noise marked).

    A row is shared when both runs have its scenario, backend label and pass."""
    from mokbench import compare

    formats = ("table", "md", "csv")
    if format not in formats:
        _fail(f"format={format!r} is invalid: allowed {' | '.join(formats)}")
    cmp = compare.compare(run_a, run_b, _split(backends))
    if format == "md":
        sys.stdout.write(compare.to_markdown(cmp, run_a, run_b))
        return
    if format == "csv":
        sys.stdout.write(compare.to_csv(cmp))
        return
    compare.render(cmp, run_a, run_b, console)


@app.command()
@_user_errors
def backends(
    world_size: int = typer.Option(None, help="EP size to judge (default: local GPUs, or 2)"),
) -> None:
    """Every registered backend, available or not, and why not."""
    from rich.markup import escape
    from rich.table import Table

    from mokbench.backend import RunContext, get_backend, registry
    from mokbench.runner import local_gpus

    _positive(world_size=world_size)
    ws = world_size or max(local_gpus("auto"), 1)
    table = Table(title=f"backends (world size {ws})")
    for col in ("backend", "kind", "available", "reason / notes"):
        table.add_column(col, overflow="fold")  # a long URL in a reason folds, never cut
    hints: list[tuple[str, str]] = []
    for name in registry():
        try:
            b = get_backend(name)
            reason = b.unavailable_reason(RunContext(world_size=ws))
            kind = "baseline" if b.capabilities.is_baseline else "mok"
            notes = b.capabilities.notes
            hint = getattr(b, "install_hint", lambda: None)()
        except Exception as exc:  # noqa: BLE001 - a broken adapter is listed, not fatal
            reason, kind, notes, hint = f"adapter failed to load: {exc}", "?", "", None
        table.add_row(name, kind, "[red]no[/red]" if reason else "[green]yes[/green]",
                      escape(reason or notes))
        if hint:
            hints.append((name, hint))
    console.print(table)
    if hints:
        console.print("how to install:")
    for name, hint in hints:
        console.print(f"  {name}: {escape(hint)}", soft_wrap=True, highlight=False)


@app.command()
@_user_errors
def calibrate(
    out: Path = typer.Option(None, help="run folder to store ceilings in (default: new)"),
    nproc_per_node: int = typer.Option(None, help="ranks (default: local GPUs, or 2 on CPU)"),
    device: str = typer.Option("auto"),
) -> None:
    """Measure GEMM, copy and all-to-all ceilings; stored in RUN_DIR/env.json."""
    from mokbench.runner import run_calibrate

    try:
        run_dir = run_calibrate(out, nproc_per_node=nproc_per_node, device=device,
                                console=console)
    except subprocess.CalledProcessError as exc:
        _fail(f"calibrate failed (exit code {exc.returncode}); its output is above")
    console.print(f"ceilings stored in [bold]{run_dir / 'env.json'}[/bold]")


@app.command()
@_user_errors
def plan(
    hidden: int = typer.Option(7168), intermediate: int = typer.Option(2048),
    sms: int = typer.Option(None, help="SMs (default: this GPU's, else 148)"),
    comm_sms: int = typer.Option(0, help="SMs given to communication"),
    block_m: int = typer.Option(128), block_n: int = typer.Option(256),
    build: int = typer.Option(None, help="also compile mok's kernel for sm_BUILD (90 | 100) "
                              "on this host, GPU or not: shared memory, registers, spills"),
    tokens: int = typer.Option(16384, help="tokens per rank (for --build's defaults)"),
    topk: int = typer.Option(8, help="top-k (for --build)"),
    world_size: int = typer.Option(1, help="EP ranks (for --build's defaults)"),
    experts: int = typer.Option(None, help="routed experts in all (for --build's defaults; "
                                "unset: one tile per work item)"),
) -> None:
    """MoK's minibatch lower bound and ring memory; with --build, how its kernel compiles.

    Lower bound: two waves of gate+up tiles. --build: the backend's defaults, then
    $MOKBENCH_MOK_CONFIG."""
    from mok_kernels import plan as mok_plan

    if build is not None and build not in (90, 100):
        _fail(f"build={build} is invalid: allowed 90 | 100")
    _positive(hidden=hidden, intermediate=intermediate, sms=sms, block_m=block_m,
              block_n=block_n, tokens=tokens, topk=topk, world_size=world_size, experts=experts)
    if sms is None:
        import torch

        sms = (torch.cuda.get_device_properties(0).multi_processor_count
               if torch.cuda.is_available() else 148)
    try:
        console.print(str(mok_plan(hidden=hidden, intermediate=intermediate, num_sms=sms,
                                   comm_sms=comm_sms, block_m=block_m, block_n=block_n)))
        if build is not None:
            if experts is not None and (experts < world_size or experts % world_size):
                _fail(f"experts={experts} is invalid: allowed a multiple of world_size "
                      f"({world_size})")
            local = None if experts is None else experts // world_size
            console.print(_build_report(build, hidden, intermediate, tokens, topk, sms,
                                        world_size, local))
    except ValueError as exc:
        _fail(str(exc))


def _build_report(arch: int, hidden: int, intermediate: int, tokens: int, topk: int, sms: int,
                  world_size: int, local_experts: int | None = None) -> str:
    """One paragraph: the mok backend's config for the shape and how its forward and backward
    kernels compile."""
    from mok_kernels import compile_megakernel
    from mokbench.mok_backend import config_from_env, default_config_fields

    cfg = config_from_env(hidden, intermediate, default_config_fields(
        hidden, intermediate, tokens, topk, sms, world_size, local_experts, arch))
    lines = [f"build for sm_{arch}: {cfg}"]
    for kernel in ("forward", "backward"):
        lw = compile_megakernel(cfg, hidden, intermediate, topk=topk,
                                comm_programs=cfg.fwd_comm_sms, programs=sms, arch=arch,
                                kernel=kernel)
        lines += [
            f"{kernel}: shared memory {lw.shared_bytes / 1024:.0f} KiB per program, "
            f"{lw.registers} registers per thread, spills: {'yes' if lw.spills else 'no'}",
            f"{kernel} MMA: {', '.join(lw.mma_instructions) or 'none'}"
            + ("; ptxas serialises the wgmma (C7515)" if lw.mma_serialized else ""),
        ]
    return "\n".join(lines)


@app.command()
@_user_errors
def slurm(
    sweep_file: Path = typer.Argument(..., help="TOML/YAML sweep, on a file system every node "
                                      "sees"),
    nodes: int = typer.Option(None, help="nodes (default: the fewest that hold the sweep's "
                              "largest world size; a GB300 NVL72 is 18 nodes x 4 GPUs)"),
    gpus_per_node: int = typer.Option(..., help="GPUs per node"),
    partition: str = typer.Option(None), account: str = typer.Option(None),
    time: str = typer.Option("02:00:00"), out: Path = typer.Option(Path("results")),
    script: Path = typer.Option(None, help="write here (default: print)"),
    dry_run: bool = typer.Option(False, help="print the torchrun command node 0 of the job "
                                 "runs for each cell, instead of the script"),
) -> None:
    """Write an sbatch script that runs the sweep across nodes with srun + torchrun.

    The sweep is checked first and every cell's world size must fit the nodes."""
    from mokbench.slurm import DEFAULT_PORT, job_nodes, render_sbatch

    nodes, note = job_nodes(sweep_file, gpus_per_node, nodes)
    text = render_sbatch(str(sweep_file), nodes, gpus_per_node, partition=partition,
                         time=time, account=account, out_dir=str(out), note=note)
    if dry_run:
        from mokbench.runner import run_sweep

        console.print(f"node 0 of {nodes} ({note}); MASTER_ADDR is the allocation's first host",
                      soft_wrap=True, markup=False)
        run_sweep(sweep_file, nproc_per_node=gpus_per_node, nnodes=nodes, node_rank=0,
                  rdzv_endpoint=f"MASTER_ADDR:{DEFAULT_PORT}", dry_run=True, console=console)
    elif script:
        try:
            script.write_text(text)
        except OSError as exc:
            _fail(f"script={str(script)!r} cannot be written ({exc.strerror or exc}): allowed a "
                  "writable file path")
        console.print(f"wrote {script}", markup=False, highlight=False)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    app()
