"""pd_engine: engine adapters that let real inference servers plug into pd-operator."""
