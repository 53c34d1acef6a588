"""One module per ``realscale`` subcommand (see ``realscale/cli.py``)."""
