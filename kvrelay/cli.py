"""The command line. Flags are generated from the frozen config dataclasses, so every
default lives in kvrelay.core.config and nowhere else."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import typing

from kvrelay.core.config import KVRelayConfig

WORKER_SECTIONS = ("model", "kv", "scheduler", "server", "lifecycle", "transfer", "security")

# Config sections each command reads its flags from.
SECTIONS = {
    "serve": (*WORKER_SECTIONS, "cluster", "router"),
    "prefill": WORKER_SECTIONS,
    "decode": WORKER_SECTIONS,
    "router": ("model", "server", "router", "cluster", "security"),
}
# Fields a command has no flag for: `serve` starts its own workers, so it takes no worker
# URLs; `router` starts none, so of the cluster section it keeps only --startup-timeout.
# Workers take no API keys: only the router and colocated servers face clients.
_CLIENT_FACING = {"security.api_key", "security.max_streams_per_key"}
# `serve` takes --shed-ttft once (the scheduler's) and gives it to its router (`serve_cluster`).
# It gives each of its workers its own --core-share slot (--share-cores).
SKIPPED = {"serve": {"router.prefill", "router.decode", "router.shed_ttft", "scheduler.core_share"},
           "router": {"cluster.num_prefill", "cluster.num_decode", "cluster.worker_threads",
                      "cluster.share_cores", "cluster.worker_base_port"},
           "prefill": _CLIENT_FACING, "decode": _CLIENT_FACING}

COMMAND_HELP = {
    "serve": "serve the OpenAI-compatible API: by default a router plus prefill and decode workers "
             "on this host (--mode colocated: one process)",
    "prefill": "run a prefill worker (give each worker its own --port; the default is 8000)",
    "decode": "run a decode worker (give each worker its own --port; the default is 8000)",
    "router": "run the router in front of prefill and decode workers started elsewhere",
    "keygen": "print a new random cluster key (kvrelay keygen > cluster.key && chmod 600 cluster.key; "
              "give every process of the cluster --cluster-key-file cluster.key)",
    "bench": "benchmark an OpenAI-compatible server (kvrelay, vLLM, SGLang, llama.cpp, ...): throughput, TTFT, "
             "TPOT, ITL, goodput under SLOs; --compare several servers in alternating rounds (docs/benchmarking.md)",
    "version": "print the versions of kvrelay and of the packages it serves with",
}
NIXL_HINT = "the nixl transfer backend is not installed: run `make nixl` (or `pip install --no-deps nixl==1.5.1 " \
            "nixl-cu12==1.5.1`), or choose --transfer-backend shm or tcp"


def _installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, None if it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return None


def version() -> str:
    return _installed("kvrelay") or "unknown"   # unknown: a source tree that was never installed


def _flag_type(tp) -> tuple[type, bool]:
    """(python type for argparse, is_optional)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return args[0], True
    return tp, False


def add_section_flags(parser: argparse.ArgumentParser, section: str, skip: typing.Collection[str] = ()) -> None:
    """One flag per field of config section `section`, except the `section.field` names in `skip`."""
    add_dataclass_flags(parser, typing.get_type_hints(KVRelayConfig)[section], section, skip)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, section: str,
                        skip: typing.Collection[str] = ()) -> None:
    """One flag per field of frozen config dataclass `cls`, its value stored as `section.field`."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(section)
    for f in dataclasses.fields(cls):
        if f"{section}.{f.name}" in skip:
            continue
        tp, _ = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f"{section}.{f.name}", default=f.default, help=flag_help(f))
        if "nargs" in f.metadata:  # a tuple field: several values after one flag
            kwargs.update(nargs=f.metadata["nargs"], type=str, metavar="VALUE")
            if f.metadata.get("action") == "extend":  # the flag may also be repeated
                kwargs.update(action="extend", default=[])
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = tp
            choices = field_choices(f)
            if choices:   # no metavar: the usage line shows {a,b,c}
                kwargs["choices"] = choices
            else:
                kwargs["metavar"] = tp.__name__.upper()
        group.add_argument(flag, **kwargs)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    return str(value)


def field_choices(f: dataclasses.Field) -> tuple | None:
    """A config field's choices: listed in its metadata, then the names of the plug-in
    registry it names ("module:attr"; lightweight: its entries import lazily)."""
    if "registry" in f.metadata:
        module, _, attr = f.metadata["registry"].partition(":")
        return (*f.metadata.get("choices", ()), *getattr(importlib.import_module(module), attr).names())
    return f.metadata.get("choices")


def flag_help(f: dataclasses.Field) -> str:
    """A field's help, with its choices and its default (unless the text already says
    what the default is), escaped for argparse's %-formatting."""
    text = f.metadata.get("help", "")
    choices = field_choices(f)
    notes = [f"choices: {', '.join(map(str, choices))}"] if choices else []
    if "(default" not in text:
        notes.append(f"default: {_shown(f.default)}")
    if notes:
        text += f" ({'; '.join(notes)})"
    return text.replace("%", "%%")


def section_values(args: argparse.Namespace, section: str) -> dict:
    """The parsed `section.field` flags as field values (a repeated flag's list as a tuple)."""
    return {k.split(".", 1)[1]: tuple(v) if isinstance(v, list) else v
            for k, v in vars(args).items() if k.startswith(section + ".")}


def config_from_args(args: argparse.Namespace) -> KVRelayConfig:
    base = KVRelayConfig()
    sections = {f.name: dataclasses.replace(getattr(base, f.name), **section_values(args, f.name))
                for f in dataclasses.fields(KVRelayConfig)}
    return KVRelayConfig(**sections)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="Prefill/decode disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvrelay {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, sections in SECTIONS.items():
        p = sub.add_parser(command, help=COMMAND_HELP[command], description=COMMAND_HELP[command])
        if command == "serve":
            p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg",
                           help="disagg: a router plus --num-prefill prefill and --num-decode decode workers "
                                "on this host; colocated: one process does prefill and decode (default: disagg)")
        for section in sections:
            add_section_flags(p, section, SKIPPED.get(command, ()))
    p = sub.add_parser("bench", help=COMMAND_HELP["bench"], description=COMMAND_HELP["bench"])
    from kvrelay.bench.config import BenchConfig
    add_dataclass_flags(p, BenchConfig, "bench")
    for command in ("keygen", "version"):
        sub.add_parser(command, help=COMMAND_HELP[command], description=COMMAND_HELP[command])
    return parser


def fail(message: str) -> typing.NoReturn:
    print(f"kvrelay: error: {message}", file=sys.stderr)
    raise SystemExit(1)


# What `serve --mode colocated` reads; a flag of any other section would be accepted and ignored.
COLOCATED_SECTIONS = ("model", "kv", "scheduler", "server", "security")
# Security fields that only a cluster's processes read: the shared key signs control
# messages between router and workers, the CA bundle is for https:// worker URLs.
CLUSTER_SECURITY = ("cluster_key_file", "ssl_ca_certs", "replay_window")


def check_colocated_flags(config: KVRelayConfig) -> None:
    """`serve --mode colocated` refuses the flags of disaggregated serving (router, workers,
    transfer, lifecycle, and the cluster's key and CA bundle), naming them: one process has
    none of those to apply them to."""
    from kvrelay.core.config import to_cli_args
    from kvrelay.server.errors import StartupError

    given = [a for f in dataclasses.fields(KVRelayConfig) if f.name not in COLOCATED_SECTIONS
             for a in to_cli_args(getattr(config, f.name)) if a.startswith("--")]
    given += [a for a in to_cli_args(config.security) if a[2:].replace("-", "_") in CLUSTER_SECURITY]
    if given:
        raise StartupError(f"{', '.join(given)}: only for disaggregated serving; --mode colocated has no router, "
                           f"workers or KV transfer (drop {'it' if len(given) == 1 else 'them'}, or serve "
                           f"disaggregated)")


def preflight(command: str, mode: str | None, config: KVRelayConfig) -> None:
    """What can fail without a model, checked before anything slow starts (torch, the
    tokenizer, workers): the nixl package, a worker's listening rules, then the port
    (claimed here, served later) and the ports `serve` will give its workers. Imports
    nothing that imports torch. Raises StartupError."""
    from kvrelay.obs.logs import setup_logging
    from kvrelay.server.errors import StartupError
    from kvrelay.server.startup import check_port_free, check_worker_ports, claim_port, worker_ports

    setup_logging(config.server.log_level, config.server.log_format)
    runs_workers = command in ("prefill", "decode") or (command == "serve" and mode != "colocated")
    transfer = config.transfer
    if command in ("prefill", "decode") and config.scheduler.shed_ttft > 0:
        raise StartupError("--shed-ttft sheds before a request is paired: give it to the router (kvrelay router "
                           "--shed-ttft, or kvrelay serve --shed-ttft), not to a worker")
    if command == "serve" and mode == "colocated":
        check_colocated_flags(config)
    if runs_workers and transfer.transfer_backend == "nixl" and importlib.util.find_spec("nixl") is None:
        raise StartupError(NIXL_HINT)
    if command in ("prefill", "decode"):
        from kvrelay.server.security import check_worker, load_cluster_key

        check_worker(config, command, load_cluster_key(config.security))
        if transfer.transfer_port:
            check_port_free(transfer.transfer_host, transfer.transfer_port, "--transfer-port")
    claim_port(config.server)
    if command == "serve" and mode != "colocated":
        check_worker_ports(config, worker_ports(config))


def _run(command: str, mode: str | None, config: KVRelayConfig) -> None:
    # Serving modules are imported only for the command that needs them.
    if command == "serve" and mode == "colocated":
        from kvrelay.server.colocated import serve_colocated
        serve_colocated(config)
    elif command == "serve":
        from kvrelay.server.cluster import serve_cluster
        serve_cluster(config)
    elif command == "router":
        from kvrelay.server.router import serve_router
        serve_router(config)
    else:
        from kvrelay.server.worker_app import serve_worker
        serve_worker(config, command)


def print_versions() -> None:
    """`kvrelay version`: what a bug report needs, without importing any of it."""
    print(f"kvrelay {version()}")
    print(f"python {sys.version.split()[0]}")
    for dist in ("torch", "transformers", "tokenizers", "huggingface_hub", "fastapi", "uvicorn", "nixl"):
        print(f"{dist} {_installed(dist) or 'not installed'}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "keygen":
        from kvrelay.core.keys import ClusterKey

        print(ClusterKey.generate().export())
        return
    if args.command == "version":
        print_versions()
        return
    if args.command == "bench":
        from kvrelay.bench.config import BenchConfig
        from kvrelay.bench.run import main as bench_main

        try:
            bench = BenchConfig(**section_values(args, "bench"))
        except ValueError as exc:
            fail(str(exc))
        raise SystemExit(bench_main(bench))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        fail(str(exc))
    if args.command == "router":
        for role in ("prefill", "decode"):
            if not getattr(config.router, role):
                fail(f"router needs at least one --{role} URL (e.g. --{role} http://127.0.0.1:8001)")
    from kvrelay.server.errors import StartupError
    from kvrelay.server.startup import release_ports

    mode = getattr(args, "mode", None)
    try:
        preflight(args.command, mode, config)
        _run(args.command, mode, config)
    except StartupError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
    finally:
        release_ports()


if __name__ == "__main__":
    main()
