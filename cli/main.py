"""Entry point of the ``actorrpc`` console script."""

from __future__ import annotations

import click

from .launch import launch
from .status import status

__all__ = ["cli", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("actorrpc")
    except PackageNotFoundError:
        return "unknown (not installed)"


@click.group(name="actorrpc", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="actorrpc")
def cli() -> None:
    """actorrpc: torch.distributed.rpc on ZeroMQ."""


cli.add_command(launch)
cli.add_command(status)


def main() -> None:
    cli(prog_name="actorrpc")


if __name__ == "__main__":
    main()
