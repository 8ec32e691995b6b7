"""`icml robust-sysid plan`: this method has no GPU part (cli/plan.py)."""
NO_GPU = "numpy and cvxpy on CPUs (IRLS and convex programs); its (experiment, seed) jobs spread over Ray CPUs"
