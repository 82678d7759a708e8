"""The ``kvtide`` command.

kvtide up [CONFIG] [--demo]     start (or join) Ray and serve the app; --demo runs the
                                multi-turn demo once the engines are up, then stops
kvtide demo [--url URL]         run the multi-turn demo against a running endpoint
kvtide model tiny DIR           write the tiny local model to DIR
kvtide config                   print the embedded default config as YAML
kvtide doctor [--fix]           check this environment (and repair what is safe to)
kvtide key new [--name NAME] [--operator]
                                print a new API key (once) and its server.api_keys entry
kvtide inspect health|stats|session ID|domains
                                read-only views of a running kvtide (docs/runbooks/)
kvtide integrity list|reuse-on  engine pairs whose KV reuse an integrity check turned off
kvtide dashboards export DIR [--source kvtide|ray]
                                write kvtide's Grafana dashboards (docs/observability.md)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


class _Stopped(Exception):
    """SIGTERM (exit code 143) or Ctrl-C (130) while ``kvtide up`` starts."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _deploy_unless_stopped(config: Any) -> Any:
    """``runtime.deploy(config)`` in a thread of its own, the main thread waiting for it
    or for SIGTERM or Ctrl-C; the layout, or ``_Stopped`` when stopped first (the caller
    shuts the app and Ray down under the deploy, which then ends on its own). Called
    after ``ray.init``, which installs Ray's own SIGTERM handler (a C++ stack trace, and
    the process gone with its Ray left to itself).

    A signal's exception raised into Ray's code (as a handler that raises would) can
    surface anywhere in it, wrapped or logged with a trace; here the handler only wakes
    the main thread, which waits in code of kvtide's own."""
    from orchestrator import runtime

    wake = threading.Event()
    outcome: dict[str, Any] = {}

    def deploy() -> None:
        try:
            outcome["layout"] = runtime.deploy(config)
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc
        finally:
            wake.set()

    def stop(*_: object) -> None:
        outcome["stopped"] = True
        wake.set()

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=deploy, name="kvtide-deploy", daemon=True).start()
    try:
        wake.wait()
    except KeyboardInterrupt:
        raise _Stopped(130) from None
    if outcome.get("stopped"):
        raise _Stopped(143)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["layout"]


def _cmd_up(args: argparse.Namespace) -> int:
    from orchestrator import runtime
    from orchestrator.config import load_config

    config = load_config(args.config)
    try:
        runtime.start_ray(config)
        try:
            layout = _deploy_unless_stopped(config)
        except _Stopped as stopped:
            print("stopped while starting", file=sys.stderr, flush=True)
            return stopped.code
        if args.demo:
            from orchestrator.cli.demo import format_turns, run_demo

            url = f"http://{config.server.host}:{config.server.port}"
            print(format_turns(run_demo(url, num_turns=args.turns)), flush=True)
            return 0
        print("press Ctrl-C to stop", file=sys.stderr, flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            runtime.supervise(config, layout, stop)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the shutdown is under way
        runtime.shutdown()


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.cli.demo import format_turns, run_demo

    print(format_turns(run_demo(args.url, num_turns=args.turns)))
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from engines.tiny_model import generate_tiny_model

    path = generate_tiny_model(args.dir)
    print(f"wrote the tiny model to {path}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from orchestrator.config import ConfigFile

    print(yaml.safe_dump(ConfigFile().model_dump(), sort_keys=False), end="")
    return 0


def _cmd_key_new(args: argparse.Namespace) -> int:
    import yaml

    from orchestrator.config import parse_config
    from orchestrator.serve.auth import hash_key, new_key

    key = new_key()
    digest = hash_key(key)
    name = args.name or f"key-{digest[:8]}"
    entry: dict[str, object] = {"name": name, "sha256": digest}
    if args.operator:
        entry["operator"] = True
    parse_config({"server": {"api_keys": [entry]}})  # the name obeys the config's rules
    snippet = yaml.safe_dump({"server": {"api_keys": [entry]}}, sort_keys=False)
    print(f"API key {name!r} (shown once: kvtide keeps only its hash, so store it now):\n")
    print(f"    {key}\n")
    print("Add this entry to server.api_keys in your kvtide config:\n")
    print(snippet, end="")
    return 0


def _cmd_dashboards_export(args: argparse.Namespace) -> int:
    from orchestrator.observability.dashboards import export_dashboards

    for path in export_dashboards(args.dir, args.source):
        print(f"wrote {path}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from orchestrator.cli.doctor import run_doctor

    return run_doctor(fix=args.fix)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtide", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="serve kvtide (embedded default without CONFIG)")
    up.add_argument("config", nargs="?", help="kvtide YAML config (see docs/config.md)")
    up.add_argument("--demo", action="store_true", help="run the demo, then stop")
    up.add_argument("--turns", type=int, default=3, help="demo turns (default 3)")
    up.set_defaults(func=_cmd_up)

    demo = sub.add_parser("demo", help="multi-turn demo against a running endpoint")
    demo.add_argument("--url", default="http://127.0.0.1:8000")
    demo.add_argument("--turns", type=int, default=3)
    demo.set_defaults(func=_cmd_demo)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("tiny", help="write the tiny local model")
    tiny.add_argument("dir")
    tiny.set_defaults(func=_cmd_model)

    cfg = sub.add_parser("config", help="print the embedded default config")
    cfg.set_defaults(func=_cmd_config)

    doctor = sub.add_parser("doctor", help="check the environment")
    doctor.add_argument(
        "--fix",
        action="store_true",
        help="uninstall torchvision/torchaudio/torchcodec builds that fail to load",
    )
    doctor.set_defaults(func=_cmd_doctor)

    key = sub.add_parser("key", help="API keys for the OpenAI API (see docs/auth.md)")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_new = key_sub.add_parser("new", help="print a new key and its server.api_keys entry")
    key_new.add_argument("--name", help="the key's name (default: key-<first 8 hash digits>)")
    key_new.add_argument(
        "--operator",
        action="store_true",
        help="an operator's key (operator: true): the operator routes, every tenant's ids",
    )
    key_new.set_defaults(func=_cmd_key_new)

    boards = sub.add_parser("dashboards", help="kvtide's Grafana dashboards")
    boards_sub = boards.add_subparsers(dest="dashboards_command", required=True)
    export = boards_sub.add_parser("export", help="write each dashboard as DIR/<uid>.json")
    export.add_argument("dir")
    export.add_argument(
        "--source",
        choices=("kvtide", "ray"),
        default="kvtide",
        help="query kvtide's GET /metrics (default) or Ray's endpoints (ray_kvtide_*)",
    )
    export.set_defaults(func=_cmd_dashboards_export)

    from orchestrator.cli.plan import add_plan_parser

    add_plan_parser(sub)
    from orchestrator.cli.inspect import add_inspect_parser

    add_inspect_parser(sub)
    from orchestrator.cli.integrity import add_integrity_parser

    add_integrity_parser(sub)
    from kernels.cli import add_parser as add_kernels_parser

    add_kernels_parser(sub)  # kvtide kernels validate|show|diff|compile
    args = parser.parse_args(argv)
    from orchestrator.errors import KVTideError

    try:
        return int(args.func(args))
    except KVTideError as exc:
        print(f"kvtide: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
