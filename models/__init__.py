"""Model families (pure torch.nn, TP-aware through neuron_opt.parallel layers)."""
