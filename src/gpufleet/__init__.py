"""gpufleet: run ML jobs across a mixed fleet of machines."""

__version__ = "0.1.0"
