"""Drivers that run the model over the paged cache without the engine's scheduler: one sequence
(``offline``), one cache per layer (``per_layer``), and a tiny random model (``tiny_model``)."""
