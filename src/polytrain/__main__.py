"""``python -m polytrain``: the same as the ``polytrain`` command."""

from polytrain.cli.app import main

main()
