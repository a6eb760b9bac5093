"""The Ray Serve application of `specdec serve --replicas`, for a cluster: `serve run specdec.deploy:app`.

    ray start --head                                   # on the head node; `ray start --address HEAD:6379` on others
    serve run specdec.deploy:app flags="qwen2.5-coder-1.5b-instruct --replicas 4 --routing affinity"

`flags` takes `specdec serve`'s flags (the model, --replicas (default 1), --routing, --replica-threads,
--max-num-seqs, --api-key, ...); the address and port are Ray Serve's (`serve run --host/--port`, or
`http_options` in a Serve config file), not --host/--port. See docs/replicas.md.
"""

from __future__ import annotations

import argparse
import shlex

from specdec.server.cli import add_serve_arguments
from specdec.server.replicas import ReplicaSpec, build_application


def app(args: dict[str, str]):
    """Ray Serve's application builder: `args` are `serve run`'s `key=value` pairs; only `flags` is known."""
    unknown = sorted(set(args) - {"flags"})
    if unknown:
        raise ValueError(f"specdec.deploy:app takes flags=\"...\" (specdec serve's flags), not {', '.join(unknown)}")
    parser = add_serve_arguments(argparse.ArgumentParser(prog="serve run specdec.deploy:app flags=", exit_on_error=False))
    try:
        flags = parser.parse_args(shlex.split(args.get("flags", "")))
    except (argparse.ArgumentError, SystemExit) as e:  # (argparse exits on an unknown flag)
        raise ValueError(f"specdec.deploy:app flags={args.get('flags', '')!r}: {e}") from None
    if flags.replicas is None:
        flags.replicas = 1
    return build_application(ReplicaSpec(flags))
