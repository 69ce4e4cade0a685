"""One module per `kvengine` command: each adds its subparser and runs it."""
