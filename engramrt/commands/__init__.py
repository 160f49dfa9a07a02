"""The ``engramrt`` subcommands, one module each; ``engramrt.cli`` builds the parser from them."""
