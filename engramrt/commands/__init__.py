"""The ``engramrt`` subcommands, one module each, holding both its flags and its work; ``flags``
holds the flags several share, ``bench_metrics`` and ``bench_client`` the parts of ``bench serve``
that need no command line. ``engramrt.cli`` names which functions build and run each command."""
