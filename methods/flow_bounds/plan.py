"""`icml flow-bounds plan`: this method has no GPU part (cli/plan.py)."""
NO_GPU = "exact sweeps in numpy and a small MLP drift on the CPU (--device is unused); seeds and losses spread over Ray CPUs"
