"""The command line. Flags are generated from the frozen config dataclasses, so every
default lives in kvrelay.core.config and nowhere else."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from kvrelay.core.config import KVRelayConfig

# Config sections each command reads its flags from.
SECTIONS = {
    "serve": ("model", "kv", "scheduler", "server"),
}


def _flag_type(tp) -> tuple[type, bool]:
    """(python type for argparse, is_optional)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return args[0], True
    return tp, False


def add_section_flags(parser: argparse.ArgumentParser, section: str) -> None:
    cls = typing.get_type_hints(KVRelayConfig)[section]
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(section)
    for f in dataclasses.fields(cls):
        tp, _ = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f"{section}.{f.name}", default=f.default, help=f.metadata.get("help", ""))
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = tp
            kwargs["metavar"] = tp.__name__.upper()
        if f.default is not None and tp is not bool:
            kwargs["help"] += f" (default: {f.default})"
        group.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> KVRelayConfig:
    base = KVRelayConfig()
    sections = {}
    for f in dataclasses.fields(KVRelayConfig):
        current = getattr(base, f.name)
        values = {k.split(".", 1)[1]: v for k, v in vars(args).items() if k.startswith(f.name + ".")}
        sections[f.name] = dataclasses.replace(current, **values)
    return KVRelayConfig(**sections)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description="Prefill/decode disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--mode", choices=("colocated",), default="colocated",
                       help="colocated: one process does prefill and decode")
    for section in SECTIONS["serve"]:
        add_section_flags(serve, section)
    return parser


def fail(message: str) -> typing.NoReturn:
    print(f"kvrelay: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        fail(str(exc))
    if args.command == "serve":
        from kvrelay.server.colocated import serve_colocated

        try:
            serve_colocated(config)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
