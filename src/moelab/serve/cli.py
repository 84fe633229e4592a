"""`moelab serve RUN_DIR`: an OpenAI-compatible HTTP server for a run's checkpoint
(see docs/serving.md). FastAPI, uvicorn and JAX are imported inside the handler, so
`moelab --help` stays fast."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from moelab.schema import int_in


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve a run's checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/models, /v1/completions, /v1/chat/completions)")
    serve.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run directory")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (0.0.0.0: every interface; there is no "
                            "authentication)")
    serve.add_argument("--port", type=int_in(0, 65535), default=8000,
                       help="port to listen on (0: any free one, printed at start)")
    serve.add_argument("--step", type=int_in(0),
                       help="serve this checkpoint step (default: the newest good one)")
    serve.add_argument("--name", help="the model name clients pass (default: RUN_DIR's name)")
    serve.add_argument("--slots", type=int_in(1, 64), default=4,
                       help="requests decoding at once, each with its own KV cache; more "
                            "wait in line")
    serve.set_defaults(func=_serve)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or a UserError naming the address and the fix."""
    from moelab.errors import UserError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # here, so a port another server listens on fails here too
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick "
                        "another --port or --host") from None
    return sock


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from moelab.serve.app import create_app
    from moelab.serve.engine import Engine

    engine = Engine.load(args.run_dir, args.step, args.name)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    chat = "with" if engine.chat_template else "without"
    print(f"moelab serve: {engine.name!r} (step {engine.step} of {args.run_dir}, context "
          f"{engine.context} tokens, {chat} a chat template) on http://{host}:{port}/v1",
          flush=True)
    config = uvicorn.Config(create_app(engine, args.slots), log_level="warning",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
