
from hetcore.openmp import limit_spinning

limit_spinning()  # before a benchmark imports torch or Numba
