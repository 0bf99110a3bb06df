"""``python -m gpufleet`` runs the CLI."""

from gpufleet.cli import main

main()
