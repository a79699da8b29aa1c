"""The `hetserve` command: the composition root that puts every package's subcommands together."""
