"""Command-line tools of actorrpc, installed as ``actorrpc.cli``.

The ``actorrpc`` console script runs :func:`actorrpc.cli.main.main`;
``actorrpc launch`` lives in :mod:`actorrpc.cli.launch`.
"""
