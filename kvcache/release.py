"""Release every directory record a node owns: `python3 -m kvcache.release --node-id NAME`.

The Kubernetes preStop hook runs it so peers stop dialing a pod before it drains; the server's
own shutdown releases whatever it claimed after that. Redis unreachable: exit 0 (nothing to
release is better than blocking a shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from .directory import Directory


async def _release(url: str, node: str) -> int:
    d = Directory(url, node, "")
    await d.start()
    try:
        return await d.release_node(node)
    finally:
        await d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--redis-url", default=os.environ.get("DSUF_REDIS_URL"))
    args = ap.parse_args(argv)
    if not args.redis_url:
        print("DSUF_REDIS_URL not set: nothing to release")
        return 0
    n = asyncio.run(_release(args.redis_url, args.node_id))
    print(f"released {n} records of {args.node_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
