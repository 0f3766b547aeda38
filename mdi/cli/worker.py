"""mdi-worker: serve one chunk of a model in a ring, run after run."""
import argparse
import os
from typing import List, Optional

from mdi.cli.arguments import ArgumentParser, device_name, positive_float, positive_int, tcp_port
from mdi.cli.process import EXIT_CONFIG, EXIT_RUN, fail, setup_process

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def worker_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mdi-worker",
        description="Serve one chunk of a model in an mdi ring. Starts blank; the starter sends "
                    "the layer range, neighbours and weights over HTTP. Serves run after run.")
    p.add_argument("--port", type=tcp_port, default=8081, help="HTTP control port (default 8081); the "
                   "data-plane port is chosen by the starter's config (default port + 1000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--device", type=device_name, help="cpu, cuda or cuda:N; overrides what the starter asks for")
    p.add_argument("--threads", type=positive_int,
                   help="compute threads (ggml's or torch's) for this node; wins over the run's runtime.threads "
                        "(default: that, else the library's default)")
    p.add_argument("--max-memory", type=positive_float, metavar="GB",
                   help="refuse runs whose KV cache, or pushed weights plus KV cache, would exceed this many "
                        "GB: a budget for those, not a cap on the process, which needs about 100 MB more on "
                        "ggml and 450 MB more on torch (Python, the library, working memory). Default: "
                        "available RAM less what a run needs beside them")
    p.add_argument("--models-dir", metavar="DIR",
                   help="the only directory whose files a run's weights.path may name (symlinks resolved; "
                        "relative paths are taken from the working directory); default: ./models")
    p.add_argument("--token-file", help="file holding the shared secret required on every request "
                   "(default: $MDI_TOKEN_FILE, else $MDI_TOKEN; never pass the secret itself on the command line)")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without a shared secret")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="DEBUG, INFO, WARNING (default) or ERROR")
    return p


def worker_main(argv: Optional[List[str]] = None) -> int:
    args = worker_parser().parse_args(argv)
    from mdi.system.http_server import HttpServer
    from mdi.worker.app import MAX_BODY_BYTES, admit_headers, create_app
    from mdi.worker.node import Worker
    setup_process(args.log_level, "%(asctime)s %(name)s %(levelname)s %(message)s", args.threads)
    from mdi.system.memory import limit_malloc_arenas
    limit_malloc_arenas()  # before the HTTP server's threads: a board serving run after run stays its size
    max_memory = int(args.max_memory * 1024 ** 3) if args.max_memory else None
    from mdi.ring.auth import TokenError, load_token
    from mdi.system.loopback import is_loopback
    try:
        token = load_token(args.token_file)
    except TokenError as e:
        return fail(str(e), EXIT_CONFIG)
    if token is None and not args.insecure and not is_loopback(args.host):
        return fail("refusing to listen on %s without a shared secret: set MDI_TOKEN or --token-file "
                    "(or pass --insecure on a trusted network)" % args.host, EXIT_CONFIG)
    if args.models_dir is not None and not os.path.isdir(args.models_dir):
        return fail("--models-dir %s is not a directory" % args.models_dir, EXIT_CONFIG)
    worker = Worker(args.host, args.port, args.device, max_memory, token, args.models_dir, args.threads)
    try:
        server = HttpServer(create_app(worker), args.host, args.port, "mdi-http", threads=8, max_connections=128,
                            max_body_bytes=MAX_BODY_BYTES, admit=admit_headers(worker), pages=False,
                            secret=token is not None).start()
    except OSError as e:
        return fail("cannot listen on %s:%d: %s" % (args.host, args.port, e.strerror or e), EXIT_RUN)
    print("mdi-worker %s listening on http://%s:%d" % (__import__("mdi").__version__, args.host, args.port),
          flush=True)
    try:
        while not worker.shutdown_requested.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    worker.end_run()  # (a run it served ends: its starter names this node, which stopped)
    server.close()
    print("mdi-worker: stopped", flush=True)  # (it had ended without a word, mid-run too)
    return 0
