"""One module per `trainprof` subcommand (see trainprof.cli.COMMANDS)."""
