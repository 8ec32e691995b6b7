"""`icml drive-world plan`: this method has no GPU part (cli/plan.py)."""
NO_GPU = "its VAE, DiT and ΔSim train on the CPU (nothing moves to --device yet); only --seeds groups spread over Ray"
