"""`icml fgad plan`: this method has no GPU part (cli/plan.py)."""
NO_GPU = "its GNN clients train on CPUs (nothing moves to --device; dense N_k × N_k per client); jobs spread over Ray CPUs"
