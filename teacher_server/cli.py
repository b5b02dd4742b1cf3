"""`opd-teacher`: run the teacher service."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer

from teacher_server.api import DEFAULT_MAX_TOP_K, SERVICE_KEEP_ALIVE_S
from teacher_server.cli_help import hide_flag_types, version_option
from teacher_server.connections import DEFAULT_HEADER_TIMEOUT_S
from teacher_server.guards import DEFAULT_BODY_TIMEOUT_S

hide_flag_types()
app = typer.Typer(
    name="opd-teacher",
    help="The standalone teacher log-prob service.",
    no_args_is_help=True,
    add_completion=False,
)

FACTORY_CACHE = Path(os.environ.get("OPD_CACHE_DIR", Path.home() / ".cache" / "opd")) / "factory"


@app.callback()
def _root(
    version: Annotated[bool, version_option("opd-teacher")] = False,
) -> None:
    """The standalone teacher log-prob service."""


SERVE_HELP = (
    "Serve POST /v1/score (see /docs for the API).\n\n"
    "hf backend memory is bounded by construction: stateless items that arrive together "
    "(from any clients) are sorted by length and scored in forwards of at most "
    "--max-batch-tokens padded ids (rows x longest row; no row shorter than its "
    "forward's longest / 1.5), right-padded without an attention mask, so memory grows "
    "linearly with the ids; session requests compute their new ids 512 at a time. With "
    "the default --max-batch-tokens no forward costs more than one max-context item "
    "alone; logits are computed at most 64 MiB at a time. A request costs its ids plus its "
    "span x top_k (the top-k rows of its answer): over --max-request-tokens it is refused "
    "(413), and the requests served at once share --max-inflight-tokens (503 while full), "
    "each token at most 256 bytes of memory while served (bench/teacher_memory.py measures "
    "it). A body is validated off the event loop in one pass, and a client that leaves has "
    "its queued work dropped.\n\n"
    "Connections are bounded too: a request's headers are due within --header-timeout-s "
    "(a connection that sends none is closed), its body within --body-timeout-s (408); "
    "bodies buffered at once stay within --max-inflight-body-mb (503 past it); an answer "
    "the client takes none of for 60 s is dropped with its connection; at "
    "--max-connections a new connection closes the one idle longest, so clients that "
    f"send requests keep being served. Between requests a connection is kept "
    f"{SERVICE_KEEP_ALIVE_S:g} s."
)


@app.command(help=SERVE_HELP)
def serve(
    model: Annotated[
        str,
        typer.Option(
            help="HF model directory, or factory:<preset>. With "
            "--backend sglang: the served model's directory "
            "(its tokenizer is read from it)."
        ),
    ],
    backend: Annotated[str, typer.Option(help="hf (transformers) or sglang.")] = "hf",
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="Port to bind (0: a free one, named on the first line).")
    ] = 8000,
    port_file: Annotated[
        Path | None,
        typer.Option(
            help="Write the bound port here once bound (atomically): how a caller that "
            "started the service with --port 0 learns it, with no port probed and bound later."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="OPD_TEACHER_API_KEY", help="Require this bearer token (or set the env var)."
        ),
    ] = None,
    sglang_url: Annotated[str, typer.Option(help="SGLang server (backend sglang).")] = (
        "http://127.0.0.1:30000"
    ),
    device: Annotated[str, typer.Option(help="hf: torch device.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="hf: float32, bfloat16 or float16.")] = "float32",
    max_context: Annotated[int | None, typer.Option(help="Longest input accepted.")] = None,
    max_top_k: Annotated[int, typer.Option(help="Largest top_k accepted.")] = DEFAULT_MAX_TOP_K,
    max_batch_size: Annotated[
        int, typer.Option(help="Items per micro-batch, cut into forwards by length (hf).")
    ] = 32,
    max_batch_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="hf: padded ids of one forward at most (rows x longest row). Default: the "
            "max context, so no forward costs more memory than one max-context item alone.",
        ),
    ] = None,
    max_request_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens of one request at most (all items: each input id once, each scored "
            "position top_k more times); more is 413, never a retryable 503. Default: "
            "max-batch-size items (sglang: 64 concurrent items) of the max context.",
        ),
    ] = None,
    max_wait_ms: Annotated[float, typer.Option(help="Batch collection window (hf).")] = 5.0,
    max_queue: Annotated[
        int,
        typer.Option(help="Items queued before 503; a request of more items is refused (413)."),
    ] = 1024,
    max_body_mb: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Largest request body in MiB, refused (413) unread past it. Default: room for "
            "max-batch-size items of max-context ids (10 bytes per id), at least 1 MiB.",
        ),
    ] = None,
    max_inflight_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens of the requests served at once, all clients together (each input "
            "id once, each scored position top_k more times); a request over it is 413, one "
            "that finds no room beside the others 503 with Retry-After. Default: 2 requests "
            "of --max-request-tokens.",
        ),
    ] = None,
    header_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds a connection has to send a request's headers, from opening or from "
            "its first byte after an answer; then it is closed.",
        ),
    ] = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds a request has to send its whole body once its headers are in; then "
            "it is answered 408 and its connection closed.",
        ),
    ] = DEFAULT_BODY_TIMEOUT_S,
    max_inflight_body_mb: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Request bodies being received and served at once, all requests together, "
            "in MiB; a body that finds no room is answered 503 with Retry-After. Default: 4 "
            "x --max-body-mb (never less than one body).",
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Open connections at most, so that accept() never runs out of descriptors; "
            "at the cap a new connection closes the one idle longest (none idle: the new one "
            "is closed). Default: the descriptor limit (raised to the hard limit) less "
            "1024, at most 16384.",
        ),
    ] = None,
    cache_budget_mb: Annotated[float, typer.Option(help="Session cache budget (hf).")] = 1024.0,
    snapshot_every: Annotated[
        int, typer.Option(help="hf, hybrid models: recurrent-state snapshot interval in tokens.")
    ] = 512,
    seed: Annotated[int, typer.Option(help="Seed of a factory: model.")] = 0,
    request_log: Annotated[
        bool,
        typer.Option(
            help="One line per request (client, method, path, status, bytes, ms) on stdout."
        ),
    ] = True,
) -> None:
    """Serve POST /v1/score (see /docs for the API)."""
    import logging

    import uvicorn

    from teacher_server.app import create_app
    from teacher_server.backend import ScoringBackend
    from teacher_server.connections import (
        TooManyConnections,
        bounded_protocol,
        install_log_limits,
        limits_within,
        raise_descriptor_limit,
    )
    from teacher_server.metrics import ServerMetrics

    chosen = _backend_name(backend)
    # the port first: a taken port is known before minutes of model loading
    listener = _listen(host, port)
    port = int(listener.getsockname()[1])
    if port_file is not None:
        _write_port(port_file, port)
    try:
        limits = limits_within(raise_descriptor_limit(), max_connections, header_timeout_s)
    except TooManyConnections as err:
        raise typer.BadParameter(str(err)) from None
    if exposed_without_key(host, api_key):
        typer.echo(
            f"opd-teacher: warning: serving on {host} without an API key: anyone who reaches "
            "this port can use the teacher (set OPD_TEACHER_API_KEY or --api-key)",
            err=True,
        )
    metrics = ServerMetrics()
    scoring: ScoringBackend
    if chosen == "hf":
        from slime_ext.models.refs import resolve_model
        from teacher_server.hf_backend import HFBackend, LimitsError

        try:
            model_dir = resolve_model(model, FACTORY_CACHE, seed)
        except (FileNotFoundError, KeyError, ValueError) as err:  # ModelRefError: a ValueError
            _fail(f"model {model}: {_first_line(err)}")
        try:
            scoring = HFBackend(
                model_dir,
                metrics,
                device=device,
                dtype=dtype,
                max_context=max_context,
                max_top_k=max_top_k,
                max_batch_size=max_batch_size,
                max_batch_tokens=max_batch_tokens,
                max_request_tokens=max_request_tokens,
                max_wait_ms=max_wait_ms,
                max_queue=max_queue,
                cache_budget_mb=cache_budget_mb,
                snapshot_every=snapshot_every,
            )
        except LimitsError as err:
            raise typer.BadParameter(str(err)) from None
        except (OSError, ValueError) as err:  # not a model transformers can load
            _fail(f"cannot load model {model_dir}: {_first_line(err)}")
    else:
        from transformers import AutoTokenizer

        from teacher_server.backend import tokenizer_identity
        from teacher_server.sglang_backend import SGLangBackend

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as err:
            _fail(f"cannot read the tokenizer of {model}: {_first_line(err)}")
        scoring = SGLangBackend(
            sglang_url,
            tokenizer,
            metrics,
            model_name=model,
            tokenizer_identity=tokenizer_identity(tokenizer),
            max_context=max_context,
            max_top_k=max_top_k,
            max_queue=max_queue,
            max_request_tokens=max_request_tokens,
        )
    if request_log:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        requests = logging.getLogger("opd-teacher.requests")
        requests.addHandler(handler)
        requests.setLevel(logging.INFO)
        requests.propagate = False
    typer.echo(
        f"opd-teacher: {chosen} backend, model {model}, http://{host}:{port}, at most "
        f"{limits.max_connections} connections"
    )
    max_body_bytes = None if max_body_mb is None else int(max_body_mb * 2**20)
    service = create_app(
        scoring,
        metrics,
        api_key,
        max_body_bytes,
        request_log=request_log,
        max_inflight_tokens=max_inflight_tokens,
        body_timeout_s=body_timeout_s,
        max_inflight_body_bytes=(
            None if max_inflight_body_mb is None else int(max_inflight_body_mb * 2**20)
        ),
    )
    config = uvicorn.Config(
        service,
        log_level="warning",
        timeout_keep_alive=int(SERVICE_KEEP_ALIVE_S),
        http=bounded_protocol(limits, metrics),  # h11 even where httptools is installed
        ws="none",
        backlog=limits.accept_backlog,
    )
    install_log_limits()  # after uvicorn.Config, which configures logging
    uvicorn.Server(config).run(sockets=[listener])


@app.command()
def sync(
    mode: Annotated[str, typer.Option(help="ema or refresh.")],
    save_dir: Annotated[Path, typer.Option(help="slime's --save directory (Megatron iter_*).")],
    work_dir: Annotated[
        Path, typer.Option(help="Converted checkpoints, the EMA, state.json, converter logs.")
    ],
    origin_hf_dir: Annotated[
        Path,
        typer.Option(help="The student's initial HF checkpoint (config, tokenizer, EMA start)."),
    ],
    steps: Annotated[int, typer.Option(help="Training steps of the job.")],
    teacher_url: Annotated[str, typer.Option(help="The teacher service.")] = (
        "http://127.0.0.1:8000"
    ),
    api_key: Annotated[
        str | None,
        typer.Option(envvar="OPD_TEACHER_API_KEY", help="The service's key (or set the env var)."),
    ] = None,
    refresh_at: Annotated[
        list[float] | None,
        typer.Option(help="refresh: a fraction of training in (0, 1]; repeat for each."),
    ] = None,
    ema_decay: Annotated[float, typer.Option(help="ema: per-step decay.")] = 0.99,
    ema_every: Annotated[int, typer.Option(help="ema: steps between averaged checkpoints.")] = 5,
    converter: Annotated[
        str,
        typer.Option(
            help="Command converting one checkpoint to HF, with {input_dir} {output_dir} "
            "{origin_hf_dir} {vocab_size}. Default: slime's tools/convert_torch_dist_to_hf.py "
            "in /root/slime with /root/Megatron-LM (slime's image)."
        ),
    ] = "",
    reload_attempts: Annotated[int, typer.Option(help="Tries of one reload.")] = 5,
    reload_backoff_s: Annotated[float, typer.Option(help="Wait after a failed try.")] = 10.0,
    reload_timeout_s: Annotated[float, typer.Option(help="Deadline of one reload.")] = 1800.0,
    poll_interval_s: Annotated[float, typer.Option(help="Save directory polling.")] = 30.0,
) -> None:
    """Follow slime's checkpoints and reload the self-teacher (OPSD ema / refresh on a
    cluster); exits once the last snapshot step is served."""
    import logging

    from pydantic import ValidationError

    from teacher_server.snapshot_sync import SnapshotSync, SyncConfig, SyncError, slime_converter

    if not api_key:
        raise typer.BadParameter(
            "the teacher's /v1/reload needs its API key: --api-key or OPD_TEACHER_API_KEY"
        )
    fields: dict[str, object] = {
        "mode": mode,
        "teacher_url": teacher_url,
        "api_key": api_key,
        "save_dir": save_dir,
        "work_dir": work_dir,
        "origin_hf_dir": origin_hf_dir,
        "steps": steps,
        "ema_decay": ema_decay,
        "ema_every": ema_every,
        "converter": converter or slime_converter("/root/slime", "/root/Megatron-LM"),
        "reload_attempts": reload_attempts,
        "reload_backoff_s": reload_backoff_s,
        "reload_timeout_s": reload_timeout_s,
        "poll_interval_s": poll_interval_s,
    }
    if refresh_at:
        fields["refresh_at"] = refresh_at
    try:
        config = SyncConfig.model_validate(fields)
    except ValidationError as err:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or 'sync'}: {e['msg'].removeprefix('Value error, ')}"
            for e in err.errors()
        ]
        typer.echo("opd-teacher sync: cannot start\n  " + "\n  ".join(problems), err=True)
        raise typer.Exit(code=2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        SnapshotSync(config).run()
    except SyncError as err:
        typer.echo(f"opd-teacher sync: failed: {err}", err=True)
        raise typer.Exit(code=1) from None


def exposed_without_key(host: str, api_key: str | None) -> bool:
    """Whether serving on `host` without a key lets other machines use the teacher."""
    if api_key:
        return False
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable
        return True


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or a one-line exit (code 2)
    saying why not."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, protocol)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)  # not listening yet: a client is refused until the model is up
    except OSError as err:
        taken = err.errno == errno.EADDRINUSE
        hint = " (another server holds it: stop it or pick --port)" if taken else ""
        _fail(f"cannot listen on {host}:{port}: {err.strerror or err}{hint}")
    listener.set_inheritable(True)
    return listener


def _write_port(path: Path, port: int) -> None:
    """`port` in `path`, written whole (a reader never sees part of it)."""
    try:
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(f"{port}\n")
        partial.replace(path)
    except OSError as err:
        _fail(f"cannot write --port-file {path}: {err.strerror or err}")


def _fail(message: str) -> NoReturn:
    typer.echo(f"opd-teacher: {message}", err=True)
    raise typer.Exit(code=2)


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


def _backend_name(name: str) -> Literal["hf", "sglang"]:
    if name not in ("hf", "sglang"):
        raise typer.BadParameter(f"backend must be 'hf' or 'sglang', not {name!r}")
    return "hf" if name == "hf" else "sglang"


def main() -> None:
    app()
