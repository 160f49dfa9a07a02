"""The ``engramrt`` subcommands, one module each (``add_arguments`` for its flags, ``run`` for the
work), plus ``flags`` for the flags several share and ``bench_metrics``/``bench_client`` behind
``bench serve``; ``engramrt.cli`` builds the parser from them."""
