"""The `hetserve` command: the composition root that puts every package's subcommands together."""
from hetcore.openmp import limit_spinning

limit_spinning()  # before any subcommand imports torch or Numba
