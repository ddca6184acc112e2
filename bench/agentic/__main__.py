"""`python -m kvgate.bench.agentic`: the agentic benchmark without the `kvgate bench` wrapper."""

import argparse
import sys

from kvgate.bench.agentic.cli import configure, main

if __name__ == "__main__":
    parser = configure(
        argparse.ArgumentParser(
            prog="python -m kvgate.bench.agentic", description="The multi-turn agentic benchmark (docs/bench.md)."
        )
    )
    sys.exit(main(parser.parse_args()))
