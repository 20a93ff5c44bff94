"""`python -m server [flags]`: the same as `python dsuf.py serve`."""

import argparse
import sys

from .lifecycle import add_serve_args, serve_main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m server", description="dsuf OpenAI-compatible server")
    add_serve_args(parser)
    sys.exit(serve_main(parser.parse_args()))
