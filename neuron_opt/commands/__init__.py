"""One module per `neuron-opt` subcommand (see neuron_opt/cli.py)."""
